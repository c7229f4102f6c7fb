"""No command line prints a traceback for a user mistake: each bad invocation of every CLI, run as a
process of its own, exits with its documented code and says what is wrong in one line on stderr.

The table is listed in docs/RELIABILITY.md. The rows run with no AWS credentials and an AWS endpoint
nobody listens on, so no row can reach a cloud. Each row is a child forked from one interpreter that
imported torch, transformers and boto3 once (tests/cli_forks.py): most rows would otherwise spend
their time importing them; a few rows run as `python -m` from a cold start as well, the way a user
runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

NO_CLUSTER = "http://127.0.0.1:9"
"""A Jobs API address nothing answers."""
JSONL_MISSING = ("--set", "data.kind=jsonl", "--set", "data.path=missing.jsonl", "--set",
                 "data.tokenizer=Qwen/Qwen2.5-1.5B")
FAKE_KEYS = (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"))
"""Credentials that pass botocore's own checks, so the call goes out to the dead endpoint."""


@dataclass(frozen=True)
class Case:
    module: str
    args: tuple[str, ...]
    exit_code: int
    message: str
    """A fragment of the one-line error on stderr."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment set for this row only, on top of the table's."""

    @property
    def id(self) -> str:
        return " ".join((*(f"{k}={v}" for k, v in self.env), self.module, *self.args))


CASES = (
    Case("capacity", (), 2, "the following arguments are required: command"),
    Case("capacity", ("probe", "--bogus"), 2, "unrecognized arguments: --bogus"),
    Case("capacity", ("probe", "--nodes", "0"), 2,
         "--nodes must be a whole number of at least 1, got '0'"),
    Case("capacity", ("probe", "--instance-type", "m7i.xlarge"), 2,
         "--instance-type m7i.xlarge has no GPU or no EFA"),
    Case("capacity", ("probe", "--regions", "us-wets-2"), 2,
         "unknown region 'us-wets-2'; did you mean us-west-2?"),
    Case("capacity", ("probe", "--regions", "us-west-2", "--all-regions"), 2,
         "--all-regions: not allowed with argument --regions"),
    Case("capacity", ("probe", "--region-timeout", "-1"), 2,
         "--region-timeout must be a positive number of seconds"),
    Case("capacity", ("probe", "--stack", "broken"), 2, "Pulumi.broken.yaml:2: is not valid YAML"),
    Case("capacity", ("probe", "--stack", "badns"), 2,
         "ray-eks:rayNamespace = 'Not_A_Label': must be a Kubernetes namespace name"),
    Case("capacity", ("probe", "--stack", "several"), 2,
         "Pulumi.several.yaml:5: rayeks:gpuNodeCount = 3: is not read: this program's keys are "
         "under `ray-eks:`. Fix: did you mean ray-eks:gpuNodeCount?"),
    Case("capacity", ("probe", "--stack", "us-wset-2"), 2,
         "--stack 'us-wset-2' is neither a stack file here nor an AWS region; did you mean --stack "
         "us-west-2? Or add --new-stack to create Pulumi.us-wset-2.yaml"),
    Case("capacity", ("probe", "--regions", "us-west-2"), 3,
         "AWS credentials problem calling sts:GetCallerIdentity: NoCredentialsError"),
    Case("capacity", ("probe", "--all-regions", "--dry-run", "--json"), 3,
         "AWS credentials problem calling sts:GetCallerIdentity: NoCredentialsError"),
    Case("capacity", ("probe", "--regions", "us-west-2"), 3,
         "ProfileNotFound: The config profile (nonexistent) could not be found; "
         "`aws configure list-profiles` lists the profiles",
         env=(("AWS_PROFILE", "nonexistent"),)),
    Case("capacity", ("probe", "--regions", "us-west-2"), 4,
         "cannot reach AWS calling sts:GetCallerIdentity: EndpointConnectionError",
         env=FAKE_KEYS),
    Case("workloads", ("frobnicate",), 2, "unknown command 'frobnicate'"),
    Case("workloads", ("verify-transport",), 2, "the following arguments are required: LOG"),
    Case("workloads", ("verify-transport", "missing.log"), 2, "cannot read missing.log"),
    Case("workloads", ("verify-transport", "--nodes", "0", "some.log"), 2,
         "--nodes: must be a whole number >= 1"),
    Case("workloads", ("verify-transport", "--expect", "ib", "some.log"), 2,
         "invalid choice: 'ib'"),
    Case("workloads", ("submit",), 2, "say which cluster: --stack NAME"),
    Case("workloads", ("submit", "--address", NO_CLUSTER, "--set", "nosuchkey=1"), 2,
         "unknown config key 'nosuchkey'"),
    Case("workloads", ("submit", "--address", NO_CLUSTER, "--config", "missing.json"), 2,
         "cannot read --config missing.json"),
    Case("workloads", ("submit", "--address", NO_CLUSTER, "--max-failures", "-1"), 2,
         "--max-failures must be >= 0"),
    Case("workloads", ("list", "--address", "localhost:9"), 3,
         "no Ray Jobs API at http://localhost:9: nothing answers"),
    # demo-cpu: the GPU presets' hub model and dataset would be pinned first, asking the hub.
    Case("workloads", ("submit", "--address", "127.0.0.1:9", "--storage-path", "/tmp/runs", "--preset", "demo-cpu"), 3,
         "no Ray Jobs API at http://127.0.0.1:9: nothing answers"),
    Case("workloads", ("list", "--address", "ray://127.0.0.1:10001"), 2,
         "is not a Ray Jobs API URL: use http://HOST:PORT"),
    Case("workloads", ("list", "--stack", "us-west-2", "--address", NO_CLUSTER), 2,
         "--stack and --address both name a cluster"),
    Case("workloads", ("logs", "--address", NO_CLUSTER), 2,
         "the following arguments are required: job_id"),
    Case("workloads", ("run", "--bogus"), 2, "unrecognized arguments: --bogus"),
    Case("workloads", ("run", "--local", "--preset", "nope"), 2, "unknown preset 'nope'"),
    Case("workloads", ("run", "--local", *JSONL_MISSING), 2,
         "data.path 'missing.jsonl' is not a file or folder here"),
    Case("workloads", ("submit", "--address", NO_CLUSTER, "--storage-path", "/tmp/s", *JSONL_MISSING), 2,
         "data.path 'missing.jsonl' is not a file or folder here"),
    Case("workloads", ("submit", "--stack", "us-west-2", "--set", "data.kind=jsonl", "--set",
                       "data.path=some.log", "--set", "data.tokenizer=./no-tokenizer"), 2,
         "data.tokenizer './no-tokenizer' is not a file or folder here"),
    Case("workloads", ("run", "--local", "--set", "data.kind=jsonl", "--set", "data.path=some.log"), 2,
         "some.log:1: not valid JSON (Expecting value)"),
    Case("workloads", ("submit", "--stack", "us-west-2", "--set", "data.kind=jsonl"), 2,
         'data.path is empty: kind "jsonl" needs the path (or s3:// URI) of a JSONL file'),
    Case("workloads", ("run", "--local", "--set", "method=dora"), 2, "method is 'dora': use one of 'full', 'lora'"),
    Case("workloads", ("run", "--local", "--set", "method=lora", "--set", "lora.rank=0"), 2,
         "lora.rank is 0: use a positive rank"),
    Case("workloads", ("run", "--local", "--set", "method=lora", "--set", 'lora.target_modules=["qkv"]'), 2,
         "lora.target_modules ['qkv'] match no linear module of the model's decoder layers; it has down_proj, "
         "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    Case("workloads", ("run", "--local", "--set", "seq_len=100000000000"), 2,
         "does not fit this machine (2 CPU ranks)"),
    Case("workloads", ("submit", "--stack", "us-west-2", "--preset", "qwen2.5-7b-24gb", "--set", "micro_batch=4",
                       "--set", "model.activation_checkpointing=false"), 2,
         "qwen2.5-7b-24gb does not fit 2 x g6.12xlarge (8 x L4): predicted "),
    Case("workloads", ("submit", "--address", NO_CLUSTER, "--instance-type", "g6.12xlarge", "--nodes", "1",
                       "--preset", "qwen2.5-7b-24gb"), 2,
         "GiB of 22.49 GiB per GPU (needs "),
    Case("workloads", ("submit", "--address", NO_CLUSTER, "--instance-type", "g6.12xlarge", "--set", "method=lora",
                       "--set", 'lora.target_modules=["proj"]'), 2, "lora.target_modules ['proj'] match no linear"),
    Case("workloads", ("submit", "--address", NO_CLUSTER, "--nodes", "2"), 2, "--nodes goes with --instance-type"),
    Case("workloads", ("plan", "--instance-type", "m7i.xlarge"), 2,
         "instance type 'm7i.xlarge' is not a GPU type this project knows"),
    Case("workloads", ("plan", "--nodes", "0"), 2, "--nodes 0: give 1 or more"),
    Case("workloads", ("export",), 2, "name the run: RUN"),
    Case("workloads", ("export", "no-such-run"), 2, "'no-such-run' is neither a folder here nor a run of"),
    Case("workloads", ("export", "some.log", "--dtype", "int8"), 2, "invalid choice: 'int8'"),
    Case("infra", (), 2, "the following arguments are required: command"),
    Case("infra", ("render", "--stack", "nope"), 2,
         "Pulumi.nope.yaml: does not exist. Fix: run `python -m capacity probe --stack nope --new-stack`"),
    Case("infra", ("render", "--stack", "bda"), 2, "Fix: did you mean --stack bad?"),
    Case("infra", ("render", "--stack", "bad"), 2,
         "Pulumi.bad.yaml:5: ray-eks:gpuNodeCount = 'two': must be a whole number"),
    Case("infra", ("render", "--stack", "broken"), 2, "Pulumi.broken.yaml:2: is not valid YAML"),
    Case("infra", ("render", "--stack", "azid"), 2,
         "Pulumi.azid.yaml:4: ray-eks:gpuAvailabilityZoneId = 'use1-az1': is an AZ ID of another "
         "region (us-west-2's start with usw2-)"),
    Case("infra", ("render", "--stack", "several"), 2,
         'Pulumi.several.yaml:6: ray-eks:kubernetesVersion = 1.30: is a number to YAML, not text: '
         'unquoted, 1.30 is read as 1.3 (trailing zeros dropped). Fix: quote it in the stack file: '
         'ray-eks:kubernetesVersion: "1.30"'),
    # A misspelt region is the region's fault, not its AZ's (whose fix, a probe of the misspelt
    # region, failed too).
    Case("infra", ("render", "--stack", "wrongregion"), 2,
         "Pulumi.wrongregion.yaml:2: aws:region = 'us-wset-2': is not an AWS region. Fix: did you mean us-west-2?"),
    # An unknown stack is bad input, said before anything else (it went on to `pulumi is not on PATH`, exit 3).
    Case("workloads", ("submit", "--stack", "us-wst-2"), 2,
         "Pulumi.us-wst-2.yaml: does not exist. Fix: did you mean --stack us-west-2?"),
    Case("workloads", ("logs", "--stack", "us-wst-2", "r1-job1"), 2, "did you mean --stack us-west-2?"),
    Case("workloads.bench", ("--steps", "0"), 2, "need warmup >= 1"),
    Case("workloads.bench", ("nccl", "--min-bytes", "lots"), 2, "not a size: 'lots'"),
    Case("workloads.bench", (), 2, "no CUDA GPU is visible: the benchmarks measure GPUs"),
    Case("workloads.bench", ("--allow-cpu",), 2, "--allow-cpu runs only the tiny-qwen2 model"),
    Case("workloads.bench", ("nccl", "--allow-cpu"), 2, "bench nccl needs at least 2 ranks, got 1"),
    Case("workloads.launch.torchrun", ("--preset", "nope"), 2, "unknown preset 'nope'"),
    Case("workloads.launch.torchrun", ("--set", "steps=0"), 2, "steps is 0: it must be at least 1"),
)

STACK_FILES = {
    "Pulumi.bad.yaml": "config:\n  aws:region: us-west-2\n  ray-eks:gpuAvailabilityZone: "
                       "us-west-2a\n  ray-eks:gpuAvailabilityZoneId: usw2-az1\n"
                       "  ray-eks:gpuNodeCount: two\n",
    "Pulumi.broken.yaml": "config: [\n",
    "Pulumi.badns.yaml": "config:\n  aws:region: us-west-2\n  ray-eks:rayNamespace: Not_A_Label\n",
    "Pulumi.azid.yaml": "config:\n  aws:region: us-west-2\n  ray-eks:gpuAvailabilityZone: "
                        "us-west-2a\n  ray-eks:gpuAvailabilityZoneId: use1-az1\n",
    "Pulumi.several.yaml": "config:\n  aws:region: us-west-2\n  ray-eks:gpuAvailabilityZone: "
                           "us-west-2a\n  ray-eks:gpuAvailabilityZoneId: usw2-az1\n"
                           "  rayeks:gpuNodeCount: 3\n  ray-eks:kubernetesVersion: 1.30\n",
    "Pulumi.wrongregion.yaml": "config:\n  aws:region: us-wset-2\n  ray-eks:gpuAvailabilityZone: "
                               "us-west-2a\n  ray-eks:gpuAvailabilityZoneId: usw2-az1\n",
    "some.log": "not an NCCL log\n",
}


COLD_STARTS = ("capacity probe --bogus", "workloads frobnicate",
               "workloads submit --address http://127.0.0.1:9 --set nosuchkey=1", "workloads.bench --steps 0",
               "infra render --stack broken", "workloads.launch.torchrun --preset nope")
"""Rows also run as `python -m` from a cold start (one per command line)."""


def _cold(case: Case, *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", case.module, *case.args], cwd=cwd,
                          env={**env, **dict(case.env)}, capture_output=True, text=True, timeout=120)


def _forked(cases, *, cwd: Path, env: dict[str, str], repo_root: Path) -> list[subprocess.CompletedProcess]:
    rows = [{"module": c.module, "args": list(c.args), "cwd": str(cwd), "env": dict(c.env),
             "stdout": str(cwd / f"row{i}.out"), "stderr": str(cwd / f"row{i}.err")} for i, c in enumerate(cases)]
    done = subprocess.run([sys.executable, str(repo_root / "tests" / "cli_forks.py")], input=json.dumps(rows),
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return [subprocess.CompletedProcess(args=[case.module, *case.args], returncode=result["returncode"],
                                        stdout=Path(row["stdout"]).read_text(), stderr=Path(row["stderr"]).read_text())
            for case, row, result in zip(cases, rows, json.loads(done.stdout), strict=True)]


@pytest.fixture(scope="module")
def results(tmp_path_factory, repo_root: Path) -> dict[str, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("cli")
    shutil.copy(repo_root / "Pulumi.yaml", cwd / "Pulumi.yaml")  # the project's root, as a user's cwd
    for name, text in STACK_FILES.items():
        (cwd / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))}
    env.update({"PYTHONPATH": str(repo_root), "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_ENDPOINT_URL": NO_CLUSTER, "AWS_MAX_ATTEMPTS": "1",
                "CUDA_VISIBLE_DEVICES": ""})  # the benchmark rows see no GPU on any machine
    with ThreadPoolExecutor(max_workers=2) as pool:
        cold = {key: pool.submit(_cold, next(c for c in CASES if c.id == key), cwd=cwd, env=env)
                for key in COLD_STARTS}
        out = dict(zip((case.id for case in CASES), _forked(CASES, cwd=cwd, env=env, repo_root=repo_root)))
        out.update({f"cold: {key}": future.result() for key, future in cold.items()})
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_user_mistake_gets_one_line_and_its_exit_code(case: Case, results):
    check(case, results[case.id])


@pytest.mark.parametrize("key", COLD_STARTS)
def test_the_same_from_a_cold_start(key: str, results):
    check(next(c for c in CASES if c.id == key), results[f"cold: {key}"])


def check(case: Case, proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert proc.returncode == case.exit_code, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if case.message in line]
    assert "error" in line


def test_every_cli_is_in_the_table():
    assert {c.module for c in CASES} == {"capacity", "workloads", "infra", "workloads.bench",
                                         "workloads.launch.torchrun"}
    assert {c.module for c in CASES if c.id in COLD_STARTS} == {c.module for c in CASES}  # each also from cold
    commands = {c.args[0] for c in CASES if c.module == "workloads" and c.args}
    assert {"submit", "logs", "run", "verify-transport", "export", "plan"} <= commands
