"""Shared fixtures. Read-only reference material (the KubeRay CRD, Helm chart values, real NCCL logs)
lives in the shared folder beside the checkout; SHARED_DIR points elsewhere. On a clone without it
the tests that need it are skipped, with the reason; under CI (`CI` set, as CI services set it) its
absence is an error, so a run that checked none of that material cannot pass."""

from __future__ import annotations

import os
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

RAY_TEST_ENV = {
    # Ray Train's controller takes a worker's report only when it polls the workers, every 2 s by
    # default, and a worker holds at most one report: a run that reports every step trains a step
    # per 2 s. Polled often, the tests' short runs take the time their steps take.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    # The head's dashboard starts nine modules, a Python process each, and fails when one is not up
    # within 30 s: on two cores that also run other tests, a (re)started head has missed that.
    "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "120",
    # And `ray start` fails the head when the dashboard has not said where it listens within 60 s:
    # a demo's head started while another cluster started on the other worker missed that.
    "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "120",
}
"""Ray settings of every Ray process the tests start (inherited from this process's environment)."""
SHARED_DIR = Path(os.environ.get("SHARED_DIR", REPO_ROOT.parent / "shared")).resolve()

RAY_FAULT_MODULES = frozenset({"test_cluster_faults", "test_idle_rehearsal"})
"""The modules that start local Ray clusters and bring faults on the clock (a node lost for a
bounded wait, a drain, an idle timeout). `make test` runs two pytest-xdist workers: these modules
run one after another on one of them, first (they are the longest part of the suite), while the
other worker takes every other module, one module at a time. Two Ray clusters at once on two cores
made a fault test take up to 2.5 times as long as alone (its timeouts are sized for one); one
cluster leaves 20-40% of the machine idle (its processes wait on polls and health checks), which
the other modules use, at a lower priority (OTHER_MODULES_NICENESS)."""
RAY_JOB_MODULES = frozenset({"test_local_demo", "test_preflight_cluster", "test_submit_cluster"})
"""The modules that start local Ray clusters to run whole jobs, with no fault on the clock: they
run last, longest first (RAY_JOB_UNITS), each unit on the worker that is free first, so
that the two workers end together instead of one waiting minutes for the other. A unit is a
module, or for test_local_demo (each of its tests starts a demo of its own) a test, and a worker
takes one only once it has nothing else to run (see ModuleScheduling). Their processes run at the
niceness of the worker that takes them."""
RAY_JOB_UNITS = ("test_submit_cluster", "test_local_demo::test_the_demo_trains", "test_preflight_cluster",
                 "test_local_demo")
"""The Ray job units longest first, by node id prefix (the first that matches): in a full `make test`
on two cores they took 177, 150, 111 and 82 s (the demo stopped with Ctrl-C, then with SIGTERM)."""
RAY_CLUSTER_MODULES = RAY_FAULT_MODULES | RAY_JOB_MODULES


def _run_order(item) -> tuple[int, int]:
    module = item.path.stem
    if module in RAY_JOB_MODULES:
        name = f"{module}::{item.name}"
        return 2, next(i for i, unit in enumerate(RAY_JOB_UNITS) if name.startswith(unit))
    return (0 if module in RAY_FAULT_MODULES else 1), 0


def pytest_collection_modifyitems(config, items):
    items.sort(key=_run_order)  # stable: each module keeps its order


OTHER_MODULES_NICENESS = 5
"""Under xdist, the worker of the other modules runs at this niceness (about a quarter of a core's
share against a process at 0), with every process it starts: the Ray clusters' processes, whose
health checks and start timeouts run on the clock, come first, and the other modules run mostly in
what those leave idle. A niceness once raised cannot be lowered: the worker that runs the Ray
fault modules (first) is raised only when it goes on to other modules after them, and the Ray job
modules (last) run at the niceness of the worker that takes them."""


def pytest_runtest_setup(item):
    if os.environ.get("PYTEST_XDIST_WORKER") and item.path.stem not in RAY_CLUSTER_MODULES:
        if (now := os.nice(0)) < OTHER_MODULES_NICENESS:
            os.nice(OTHER_MODULES_NICENESS - now)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's load-scope scheduling with one scope per module, one for all the Ray fault
    modules, and one per test of test_local_demo. (Its `--dist loadgroup` does not group under pytest 9: the
    group it writes into each test's node id does not reach the scheduler.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            stem = _module_of(nodeid)
            return ("ray-faults" if stem in RAY_FAULT_MODULES else nodeid if stem == "test_local_demo"
                    else nodeid.split("::", 1)[0])

        def _reschedule(self, node) -> None:
            # xdist hands a worker its next unit while it still has two tests to run. At the end of
            # the run that let one worker take all the Ray job units while the other, a few minutes
            # from the end of the fault modules, then found none left: a Ray job unit goes only to
            # a worker down to its last test (which a worker holds until it gets more or is told to
            # stop, so it has nothing else to do).
            if (self.workqueue and not node.shutting_down and _module_of(next(iter(self.workqueue))) in RAY_JOB_MODULES
                    and self._pending_of(self.assigned_work[node]) > 1):
                return
            super()._reschedule(node)

    def _module_of(nodeid_or_scope: str) -> str:
        """The test module's name (its file's stem) in a node id or scope."""
        return Path(nodeid_or_scope.split("::", 1)[0]).stem

    return ModuleScheduling(config, log)


def running_under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session", autouse=True)
def ray_test_env(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        for name, value in RAY_TEST_ENV.items():
            env.setenv(name, value)
        # What `submit` records of each submission (workloads/client/run_record.py) stays in the run.
        env.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("xdg-state")))
        yield


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED_DIR / "DESIGN.md").is_file():
        reason = f"reference files not found at {SHARED_DIR}; set SHARED_DIR to the shared folder"
        if running_under_ci():
            pytest.fail(f"{reason} (CI={os.environ['CI']}: there, a missing shared folder fails the run)",
                        pytrace=False)
        pytest.skip(reason)
    return SHARED_DIR


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="module")
def botocore_session():
    """One botocore session per module, so the AWS service models load once, not once per test."""
    import botocore.session

    return botocore.session.get_session()


@pytest.fixture
def fake_aws_session(botocore_session):
    """A boto3 session with fake credentials in us-west-2, for moto or a botocore Stubber."""
    import boto3

    return boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name="us-west-2", botocore_session=botocore_session)


@contextmanager
def _iam_enforced(endpoint: str):
    """Make the moto server at `endpoint` check every request's signature and IAM policy, and put
    moto back as it was afterwards: the setting is global to moto in this process, and later tests'
    in-process moto mocks must not inherit it."""

    def reset_auth(count: str) -> None:
        request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request).close()

    reset_auth("0")
    try:
        yield
    finally:
        reset_auth("inf")


@pytest.fixture(scope="session")
def iam_enforced():
    """`with iam_enforced(endpoint):` moto checks IAM inside the block only (see `_iam_enforced`)."""
    return _iam_enforced
