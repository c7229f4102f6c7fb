"""`python -m infra lock-images --stack NAME`: each image of the stack resolved to its digest through the
registry's OCI distribution API (an anonymous token from the registry's challenge, then HEAD of the
manifest with the Accept headers of indexes, manifest lists and manifests) and written back as
`repo:tag@sha256:...`, every other line of the stack file kept. Against a registry on 127.0.0.1 that
speaks the protocol (tests/oci_registry.py); the command runs as users run it, in its own process.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from infra.config import ConfigError, load_stack_config
from infra.images import unpinned_images
from infra.lock_images import plan_lock
from infra.registry import DOCKER_HUB, MANIFEST_MEDIA_TYPES, ImageReference, RegistryClient
from oci_registry import DOCKER_MANIFEST, DOCKER_MANIFEST_LIST, OCI_INDEX, OCI_MANIFEST, OciRegistry
from workloads.client.cluster import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "deep-learning-containers/ray"
TAG = "train-ml-cuda-v1.1"
IMAGE_LINE = "  ray-eks:rayImage: {image}   # the Ray image, kept as written\n"
LOCKED_LINE = "  ray-eks:rayImage: {image} # the Ray image, kept as written"
"""The image's line once locked: its comment kept, one space before it (ruamel.yaml's, past the column)."""


@pytest.fixture
def registry():
    served = OciRegistry().start()
    yield served
    served.stop()


def _project(tmp_path: Path, image: str | None) -> Path:
    """A project folder with the committed stack's file as stack `dev`, naming `image` (or no image)."""
    (tmp_path / "Pulumi.yaml").write_text((REPO_ROOT / "Pulumi.yaml").read_text())
    lines = (REPO_ROOT / "Pulumi.us-west-2.yaml").read_text().splitlines(keepends=True)
    if image is not None:
        at = next(i for i, line in enumerate(lines) if "ray-eks:gpuNodeCount" in line) + 1
        lines.insert(at, IMAGE_LINE.format(image=image))
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text("".join(lines))
    return path


def _lock_images(tmp_path: Path, *args: str, stack: str = "dev") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra", "lock-images", "--stack", stack,
                           "--project-dir", str(tmp_path), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def _changed_lines(before: str, after: str) -> list[str]:
    return [line for line in difflib.ndiff(before.splitlines(), after.splitlines()) if line[:2] in ("- ", "+ ")]


@pytest.mark.parametrize("media_type", [OCI_INDEX, DOCKER_MANIFEST_LIST, OCI_MANIFEST, DOCKER_MANIFEST])
def test_the_tag_is_pinned_by_its_digest_and_nothing_else_of_the_file_changes(tmp_path, registry, media_type):
    digest = registry.push(REPOSITORY, TAG, media_type)
    image = f"{registry.host}/{REPOSITORY}:{TAG}"
    path = _project(tmp_path, image)
    before = path.read_text()
    done = _lock_images(tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [f"ray-eks:rayImage: {image} -> {image}@{digest}",
                                        f"{path}: written"]
    assert _changed_lines(before, path.read_text()) == [
        "- " + IMAGE_LINE.format(image=image).rstrip("\n"),
        "+ " + LOCKED_LINE.format(image=f"{image}@{digest}")]
    cfg = load_stack_config("dev", tmp_path)
    assert cfg.ray_image == f"{image}@{digest}" and unpinned_images(cfg) == {}
    # The protocol as public.ecr.aws has it: challenged, an anonymous token for the repository, then the
    # manifest asked for with every manifest type accepted, indexes first.
    (first, token, head) = registry.requests
    assert (first[0], first[1], "Authorization" in first[2]) == ("HEAD", f"/v2/{REPOSITORY}/manifests/{TAG}", False)
    assert token[:2] == ("GET", "/token/")
    assert (head[0], head[2]["Authorization"].startswith("Bearer ")) == ("HEAD", True)
    assert [a.strip() for a in head[2]["Accept"].split(",")] == list(MANIFEST_MEDIA_TYPES)


def test_a_registry_that_leaves_the_digest_off_head_is_asked_for_the_manifest(tmp_path, registry):
    registry.digest_on_head = False
    digest = registry.push(REPOSITORY, TAG, OCI_INDEX)
    path = _project(tmp_path, f"{registry.host}/{REPOSITORY}:{TAG}")
    assert _lock_images(tmp_path).returncode == 0
    assert LOCKED_LINE.format(image=f"{registry.host}/{REPOSITORY}:{TAG}@{digest}") in path.read_text()
    assert [m for m, *_ in registry.requests if m == "GET"][-1:] == ["GET"]


def test_a_second_run_changes_nothing_and_a_moved_tag_is_followed(tmp_path, registry):
    registry.push(REPOSITORY, TAG, OCI_INDEX, seed="first build")
    image = f"{registry.host}/{REPOSITORY}:{TAG}"
    path = _project(tmp_path, image)
    assert _lock_images(tmp_path).returncode == 0
    locked = path.read_text()
    again = _lock_images(tmp_path)
    assert again.returncode == 0 and path.read_text() == locked
    assert again.stdout.splitlines()[-1] == f"{path}: every image already pinned by the digest its tag names"
    moved = registry.push(REPOSITORY, TAG, OCI_INDEX, seed="the tag moved to another build")
    followed = _lock_images(tmp_path)
    assert followed.returncode == 0
    assert followed.stdout.splitlines()[0].endswith(f"-> {image}@{moved}")
    assert len(_changed_lines(locked, path.read_text())) == 2


def test_dry_run_shows_the_change_and_writes_nothing(tmp_path, registry):
    digest = registry.push(REPOSITORY, TAG, OCI_INDEX)
    path = _project(tmp_path, f"{registry.host}/{REPOSITORY}:{TAG}")
    before = path.read_text()
    done = _lock_images(tmp_path, "--dry-run")
    assert done.returncode == 0 and path.read_text() == before
    assert f"+  ray-eks:rayImage: {registry.host}/{REPOSITORY}:{TAG}@{digest}" in done.stdout


def test_a_stack_that_names_no_image_gets_its_default_image_locked(tmp_path, registry):
    """The committed stack deploys the DLC image by default: locking it adds the key. The client is
    pointed at the local registry for public.ecr.aws (the command itself always asks the real one)."""
    digest = registry.push(REPOSITORY, TAG, OCI_INDEX)
    _project(tmp_path, None)
    client = RegistryClient(endpoints={"public.ecr.aws": registry.url})
    locked, update = plan_lock(stack="dev", project_dir=tmp_path, resolve=client.digest)
    image = f"public.ecr.aws/{REPOSITORY}:{TAG}"
    assert [(i.key, i.before, i.after) for i in locked] == [("ray-eks:rayImage", image, f"{image}@{digest}")]
    assert _changed_lines(update.before, update.after) == [f"+   ray-eks:rayImage: {image}@{digest}"]


# --- its errors: one line each, the file untouched --------------------------------------------------

@pytest.mark.parametrize(("case", "code", "message"), [
    ("unknown stack", 2, "infra lock-images: error: {unknown_stack}"),
    ("registry unreachable", 4, "infra lock-images: error: ray-eks:rayImage = '{image}': cannot reach the "
                                "registry {host}: connection refused. Fix: check the network path to {host} "
                                "(a proxy, a firewall), or run lock-images from a machine that reaches it"),
    ("tag not found", 1, "infra lock-images: error: ray-eks:rayImage = '{image}': the registry has no tag "
                         "train-ml-cuda-v9.9 in {host}/deep-learning-containers/ray (MANIFEST_UNKNOWN). Fix: "
                         "name a tag the repository has"),
    ("repository not found", 1, "infra lock-images: error: ray-eks:rayImage = '{image}': the registry has no "
                                "repository {host}/deep-learning-containers/rey (NAME_UNKNOWN). Fix: name a "
                                "tag the repository has"),
    ("anonymous pull refused", 3, "infra lock-images: error: ray-eks:rayImage = '{image}': the registry {host} "
                                  "refused an anonymous token (HTTP 403: anonymous pull not allowed). Fix: "
                                  "lock-images reads public images only; pin the digest by hand"),
])
def test_each_failure_is_one_line_with_its_exit_code(tmp_path, registry, case, code, message):
    registry.push(REPOSITORY, TAG, OCI_INDEX)
    host = registry.host
    image = {"registry unreachable": f"127.0.0.1:{free_port()}/{REPOSITORY}:{TAG}",
             "tag not found": f"{host}/{REPOSITORY}:train-ml-cuda-v9.9",
             "repository not found": f"{host}/deep-learning-containers/rey:{TAG}"}.get(
                 case, f"{host}/{REPOSITORY}:{TAG}")
    registry.refuse_tokens = case == "anonymous pull refused"
    path = _project(tmp_path, image)
    before = path.read_text()
    done = _lock_images(tmp_path, stack="nope" if case == "unknown stack" else "dev")
    shown_host = image.split("/")[0]
    with pytest.raises(ConfigError) as unknown_stack:  # the project's own words for a stack it lacks
        load_stack_config("nope", tmp_path)
    assert "Pulumi.nope.yaml: does not exist" in str(unknown_stack.value)
    assert done.stderr == message.format(unknown_stack=unknown_stack.value, image=image, host=shown_host) + "\n"
    assert (done.returncode, done.stdout) == (code, "")
    assert path.read_text() == before


def test_a_bad_value_elsewhere_in_the_stack_file_stops_it_before_any_request(tmp_path, registry):
    path = _project(tmp_path, f"{registry.host}/{REPOSITORY}:{TAG}")
    path.write_text(path.read_text().replace("ray-eks:gpuNodeCount: 2", "ray-eks:gpuNodeCount: two"))
    done = _lock_images(tmp_path)
    assert done.returncode == 2 and registry.requests == []
    assert done.stderr.startswith(f"infra lock-images: error: {path}:9: ray-eks:gpuNodeCount = 'two': must be")


@pytest.mark.parametrize(("text", "registry", "repository", "tag", "digest"), [
    (f"public.ecr.aws/{REPOSITORY}:{TAG}", "public.ecr.aws", REPOSITORY, TAG, None),
    (f"public.ecr.aws/{REPOSITORY}:{TAG}@sha256:{'a' * 64}", "public.ecr.aws", REPOSITORY, TAG, "sha256:" + "a" * 64),
    (f"127.0.0.1:5000/{REPOSITORY}:{TAG}", "127.0.0.1:5000", REPOSITORY, TAG, None),
    (f"localhost/ray@sha256:{'b' * 64}", "localhost", "ray", None, "sha256:" + "b" * 64),
    ("rayproject/ray:2.58.0", DOCKER_HUB, "rayproject/ray", "2.58.0", None),  # Docker Hub, by Docker's rules
    ("busybox:1.36", DOCKER_HUB, "library/busybox", "1.36", None),
    ("docker.io/library/busybox:1.36", DOCKER_HUB, "library/busybox", "1.36", None),
])
def test_image_references_are_read_as_kubernetes_reads_them(text, registry, repository, tag, digest):
    ref = ImageReference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest)
    if tag:
        assert ref.pinned("sha256:" + "c" * 64) == f"{ref.name}:{tag}@sha256:{'c' * 64}"
