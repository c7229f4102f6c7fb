"""`pulumi up` deploys only images pinned by digest, unless the stack says otherwise; `pulumi preview`
warns. The program tells the two apart by `pulumi.runtime.is_dry_run()`, which the engine sets from
its RunRequest's `dryRun` (pulumi/automation/_server.py passes it to `reset_options(preview=...)`, as
the CLI's language host does). One test sends the program that RunRequest through the SDK's own
language server, with a resource monitor on 127.0.0.1; the others run it under the mocks with
`preview` as the engine would set it.
"""

from __future__ import annotations

import json
import runpy
from concurrent import futures

import grpc
import pulumi
import pytest
from google.protobuf import empty_pb2, struct_pb2
from pulumi.automation._server import LanguageServer
from pulumi.runtime import settings
from pulumi.runtime.proto import language_pb2, resource_pb2, resource_pb2_grpc

from infra.config import DEFAULT_RAY_IMAGE, parse_stack_config, read_stack_values
from infra.images import unpinned_images
from infra.program_mocks import Mocks, ProgramRun
from infra.program_mocks import run_program as run_program_under_mocks
from test_infra_program import REPO_ROOT

STACK_FILE = REPO_ROOT / "Pulumi.us-west-2.yaml"
DIGEST = "sha256:" + "4f" * 32
LOCKED = f"{DEFAULT_RAY_IMAGE}@{DIGEST}"


class _Seen(Mocks):
    """The mocks, also keeping the run they record where a test can read it after the program failed."""

    runs: list[ProgramRun] = []

    def __init__(self, run, region, zones=None):
        super().__init__(run, region, zones)
        _Seen.runs.append(run)


def _run(config: dict, *, preview: bool) -> ProgramRun:
    return run_program_under_mocks(project_dir=REPO_ROOT, stack="us-west-2", config=config, preview=preview,
                                   mocks=_Seen)


def _refusal(stack: str) -> str:
    return (f"stack {stack}: ray-eks:rayImage = '{DEFAULT_RAY_IMAGE}' is pinned by tag only, which its registry "
            "can move to other code: pulumi up deploys images pinned by digest. Fix: python -m infra lock-images "
            f"--stack {stack} (writes repo:tag@sha256:... into Pulumi.{stack}.yaml), or, to deploy it anyway, "
            "pulumi config set ray-eks:allowUnpinnedImages true")


def _images(run: ProgramRun) -> set[str]:
    (rc,) = run.of_type("kubernetes:ray.io/v1:RayCluster")
    spec = rc.inputs["spec"]
    pods = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
    return {c["image"] for pod in pods for c in pod["spec"]["containers"]}


def test_pulumi_up_refuses_an_image_pinned_by_tag_only_before_declaring_anything():
    config = read_stack_values(STACK_FILE)  # the committed stack: the DLC image by its version tag
    _Seen.runs.clear()
    with pytest.raises(pulumi.RunError) as info:
        _run(config, preview=False)
    assert str(info.value) == _refusal("us-west-2")
    (run,) = _Seen.runs
    assert run.resources == []


def test_pulumi_preview_of_the_same_stack_declares_everything_and_warns():
    run = _run(read_stack_values(STACK_FILE), preview=True)
    assert _images(run) == {DEFAULT_RAY_IMAGE}
    (warning,) = [w for w in run.warnings if "lock-images" in w]
    assert warning.startswith(f"pulumi up will refuse ray-eks:rayImage = '{DEFAULT_RAY_IMAGE}'")


def test_a_locked_image_or_a_stack_that_allows_tags_is_deployed():
    locked = _run({**read_stack_values(STACK_FILE), "ray-eks:rayImage": LOCKED}, preview=False)
    assert _images(locked) == {LOCKED}
    assert not [w for w in locked.warnings if "lock-images" in w]
    allowed = _run({**read_stack_values(STACK_FILE), "ray-eks:allowUnpinnedImages": True}, preview=False)
    assert _images(allowed) == {DEFAULT_RAY_IMAGE}
    (warning,) = [w for w in allowed.warnings if "allowUnpinnedImages" in w]
    assert "deploys ray-eks:rayImage pinned by tag only" in warning


@pytest.mark.parametrize(("image", "pinned"), [
    (DEFAULT_RAY_IMAGE, False), (LOCKED, True), (f"public.ecr.aws/x/ray@{DIGEST}", True),
    ("registry.local:5000/ray:v1.1", False),
])
def test_what_counts_as_pinned_by_digest(image, pinned):
    cfg = parse_stack_config({**read_stack_values(STACK_FILE), "ray-eks:rayImage": image})
    assert unpinned_images(cfg) == ({} if pinned else {"ray-eks:rayImage": image})


class _StackOnlyMonitor(resource_pb2_grpc.ResourceMonitorServicer):
    """A resource monitor on 127.0.0.1 that takes the stack's own registration and refuses the rest: what
    a program that stops before declaring anything needs."""

    def __init__(self) -> None:
        self.registered: list[str] = []

    def SupportsFeature(self, request, context):
        return resource_pb2.SupportsFeatureResponse(hasSupport=False)

    def RegisterResource(self, request, context):
        self.registered.append(request.type)
        if request.type != "pulumi:pulumi:Stack":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.type} registered")
        return resource_pb2.RegisterResourceResponse(urn=f"urn:pulumi:us-west-2::ray-eks::{request.type}::s",
                                                     object=struct_pb2.Struct())

    def RegisterResourceOutputs(self, request, context):
        return empty_pb2.Empty()


@pytest.fixture
def monitor():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _StackOnlyMonitor()
    resource_pb2_grpc.add_ResourceMonitorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)
        settings.reset_options()
        pulumi.runtime.set_all_config({})


def _engine_run(program, *, address: str, dry_run: bool, config: dict) -> language_pb2.RunResponse:
    """What the engine asks of the language host for `pulumi up` (dryRun false) or `pulumi preview`,
    served by the SDK's own LanguageServer (pulumi/automation/_server.py)."""
    request = language_pb2.RunRequest(
        project="ray-eks", stack="us-west-2", dryRun=dry_run, monitor_address=address, parallel=1,
        config={k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()})
    return LanguageServer(program).Run(request, None)


def test_pulumi_ups_run_request_stops_the_real_program_with_one_line(monitor):
    servicer, address = monitor
    config = read_stack_values(STACK_FILE)
    up = _engine_run(lambda: runpy.run_path(str(REPO_ROOT / "__main__.py"), run_name="__main__"),
                     address=address, dry_run=False, config=config)
    assert up.error == _refusal("us-west-2")
    assert servicer.registered == ["pulumi:pulumi:Stack"]  # nothing of the program's was declared
    seen: list[bool] = []
    preview = _engine_run(lambda: seen.append(pulumi.runtime.is_dry_run()), address=address, dry_run=True,
                          config=config)
    assert (preview.error, seen) == ("", [True])
