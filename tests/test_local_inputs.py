"""`run --local` and `submit` check the inputs a config names on this machine before any cluster is
started or reached (workloads/client/inputs_check.py): a bad JSONL line, a folder that is no model
or tokenizer, a value that is no source at all, a hub that cannot be reached. Each is one line and
exit 2 within seconds, where it used to surface after the local cluster had started (72-107 s in).
Also: the user's own data trains locally with nothing more than its kind and path."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_hub import fake_hub

from workloads.client import inputs_check, overrides
from workloads.local import demo
from workloads.local import run as local
from workloads.client.datapaths import local_inputs

CHAT = {"messages": [{"role": "user", "content": "What colour is the sky?"},
                     {"role": "assistant", "content": "Blue."}]}
ALPACA = {"instruction": "What colour is the sky?", "input": "", "output": "Blue."}
SHAREGPT = {"conversations": [{"from": "human", "value": "What colour is the sky?"}, {"from": "gpt", "value": "Blue."}]}
NO_CLUSTER = "http://127.0.0.1:9"
FAST_S = 10.0
"""Far under a local cluster's start (30-65 s on two busy cores), far over the checks' own time."""


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "mychats.jsonl", [json.dumps(CHAT)] * 3)
    write_jsonl(tmp_path / "broken.jsonl", [json.dumps(CHAT), json.dumps(CHAT),
                                            '{"messages": [{"role": "user", "content": "x"}'])
    write_jsonl(tmp_path / "alpaca.jsonl", [json.dumps(ALPACA), json.dumps({**ALPACA, "text": "also a text"})])
    write_jsonl(tmp_path / "sharegpt.jsonl", [json.dumps(SHAREGPT), json.dumps({"conversations": [
        {"from": "human", "value": "What colour is coal?"}, {"from": "robot", "value": "Black."}]})])
    (tmp_path / "empty-folder").mkdir()
    return tmp_path


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[float, subprocess.CompletedProcess]:
    repo = Path(__file__).resolve().parent.parent
    full_env = {**os.environ, "PYTHONPATH": str(repo), **(env or {})}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "workloads", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=120)
    return time.monotonic() - start, done


JSONL = ("--set", "data.kind=jsonl", "--set")


@pytest.mark.parametrize(("args", "env", "message"), [
    ((*JSONL, "data.path=broken.jsonl"), {},
     "broken.jsonl:3: not valid JSON (Expecting ',' delimiter)"),
    ((*JSONL, "data.path=mychats.jsonl", "--set", "data.tokenizer=nosuch/dir/"), {},
     "data.tokenizer 'nosuch/dir/' is neither a file or folder here, an s3:// URI nor a Hugging Face id (ORG/NAME)"),
    ((*JSONL, "data.path=mychats.jsonl", "--set", "data.tokenizer=./empty-folder"), {},
     "empty-folder' holds no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json)"),
    (("--set", "model.name_or_path=./empty-folder"), {},
     "empty-folder' has no config.json: it is not a Hugging Face model folder"),
    (("--set", "model.name_or_path=Qwen/Qwen2.5-0.5B"), {"HF_ENDPOINT": NO_CLUSTER},
     "cannot reach the Hugging Face hub at http://127.0.0.1:9 for hub model 'Qwen/Qwen2.5-0.5B' ("),
    (("--set", "model.name_or_path=Qwen/Qwen2.5-0.5B"), {"HF_HUB_OFFLINE": "1"},
     "hub model 'Qwen/Qwen2.5-0.5B' is not in this machine's cache and HF_HUB_OFFLINE is set"),
    (("--set", "data.path=mychats"), {},
     "data.path is 'mychats' but data.kind is not set (the preset's is 'synthetic'), and the path names no kind: add "
     "--set data.kind=jsonl"),
    (("--set", "data.path=alpaca.jsonl"), {},
     "alpaca.jsonl:2: the record fits the formats alpaca and text: set data.format to the one it is"),
    (("--set", "data.path=sharegpt.jsonl"), {},
     "sharegpt.jsonl:2: turn 1 is from 'robot': ShareGPT turns are from one of system, human, user, gpt"),
    (("--set", "data.path=sharegpt.jsonl", "--set", "data.format=alpaca"), {},
     "sharegpt.jsonl:1: data.format is 'alpaca' but the record has no Alpaca's 'instruction' and 'output'"),
], ids=["bad-jsonl-line", "tokenizer-no-source", "tokenizer-empty-folder", "model-empty-folder", "hub-unreachable",
        "hub-offline", "data-path-of-no-kind", "alpaca-ambiguous", "sharegpt-bad-role", "format-mismatch"])
def test_a_local_input_mistake_is_one_line_before_the_cluster_starts(workdir, args, env, message):
    took, done = run("run", "--local", "--runs-dir", str(workdir / "runs"), *args, cwd=workdir,
                     env={"WORKLOADS_CACHE": str(workdir / "cache"), **env})
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("run: error: ") and message in line
    assert "starting a Ray cluster" not in done.stdout and not (workdir / "runs").exists()
    assert took < FAST_S, f"{took:.1f} s"


def test_submit_checks_the_tokenizer_before_connecting(workdir):
    took, done = run("submit", "--address", NO_CLUSTER, "--storage-path", "/tmp/runs", "--preset", "demo-cpu",
                     *JSONL, "data.path=mychats.jsonl", "--set", "data.tokenizer=nosuch/dir/", cwd=workdir)
    assert done.returncode == 2
    assert "data.tokenizer 'nosuch/dir/' is neither a file or folder here" in done.stderr
    assert "no Ray Jobs API" not in done.stderr  # refused before the cluster was reached
    took, done = run("submit", "--stack", "us-west-2", *JSONL, "data.path=broken.jsonl", cwd=workdir)
    assert done.returncode == 2 and "broken.jsonl:3: not valid JSON" in done.stderr


# --- the hub, answered by a stand-in ----------------------------------------------------------------


@pytest.fixture
def hub(monkeypatch):
    with fake_hub(monkeypatch) as asked:
        yield asked


def _config(**model) -> dict:
    from workloads.train.config import preset, with_overrides

    return with_overrides(preset("demo-cpu"), [f"model.{k}={v}" for k, v in model.items()]).to_dict()


def test_a_hub_model_that_does_not_exist_is_named(hub, tmp_path):
    train = {**_config(name_or_path="org/missing"), "cache_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=r"^hub model 'org/missing' does not exist on the Hugging Face hub \(or is "
                                         r"private: set HF_TOKEN\): check the id"):
        inputs_check.check_inputs(train, local={}, hub=True)
    inputs_check.check_inputs({**_config(name_or_path="org/there"), "cache_dir": str(tmp_path)}, local={}, hub=True)
    assert hub == ["/api/models/org/missing", "/api/models/org/there"]


def test_the_hub_is_asked_only_when_this_machine_needs_it(hub, tmp_path):
    train = {**_config(name_or_path="org/missing"), "cache_dir": str(tmp_path)}
    inputs_check.check_inputs(train, local={}, hub=False)  # submit: the cluster reaches the hub, not this machine
    (tmp_path / "hub--org_missing--default").mkdir()  # in the node cache: nothing to download
    inputs_check.check_inputs(train, local={}, hub=True)
    assert hub == []


# --- your own data, locally ------------------------------------------------------------------------


def _args(*sets: str) -> argparse.Namespace:
    return argparse.Namespace(preset="demo-cpu", set=list(sets), nodes=2, cpus_per_node=1)


def test_your_own_data_alone_trains_the_toy_model_with_its_tokenizer(workdir, monkeypatch):
    """It stopped with "data.tokenizer is empty": the demo preset's tiny-qwen2 has no tokenizer."""
    monkeypatch.chdir(workdir)
    run_dir = workdir / "runs" / "1"
    train, inputs = local.local_train_config(_args("data.kind=jsonl", "data.path=mychats.jsonl"), run_dir)
    assert train["model"]["name_or_path"] == str(run_dir / "base-model") and inputs.model == run_dir / "base-model"
    assert train["data"]["path"] == str(workdir / "mychats.jsonl") and inputs.chats is None
    assert inputs.fields == {"model.name_or_path"}
    assert demo.closing_question(train).prompt == "What colour is the sky?"  # what the trained model is asked
    assert not run_dir.exists()  # nothing written until the checks passed


def test_a_data_path_alone_names_its_kind(workdir, monkeypatch):
    """`--set data.path=mychats.jsonl` without data.kind trained on synthetic tokens (the demo preset's kind)
    and said "your data trains a toy model"; the path now names the kind, and a config that still pairs
    "synthetic" with a path is refused."""
    from workloads.train.config import DataConfig

    monkeypatch.chdir(workdir)
    train, inputs = local.local_train_config(_args("data.path=mychats.jsonl"), workdir / "runs" / "1")
    assert train["data"]["kind"] == "jsonl" and train["data"]["path"] == str(workdir / "mychats.jsonl")
    assert inputs.model is not None and inputs.chats is None
    (workdir / "chats-no-suffix").write_text(json.dumps(CHAT) + "\n")  # a file here is a file, whatever its name
    train, _ = local.local_train_config(_args("data.path=chats-no-suffix"), workdir / "runs" / "2")
    assert train["data"]["kind"] == "jsonl"
    assert overrides.kind_of_path("HuggingFaceH4/ultrachat_200k", cwd=workdir) == "hub"
    assert overrides.kind_of_path("s3://bucket/chats", cwd=workdir) == "jsonl"
    with pytest.raises(ValueError, match='data.kind is "synthetic", which generates its tokens and reads no file'):
        DataConfig(kind="synthetic", path="mychats.jsonl")


def test_your_data_on_a_model_of_a_demo_run_uses_its_tokenizer(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    model = workdir / "runs" / "0" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    args = _args("data.kind=jsonl", "data.path=mychats.jsonl", "model.name_or_path=runs/0/model")
    with pytest.raises(ValueError, match="holds no tokenizer, which the data needs"):
        local.local_train_config(args, workdir / "runs" / "1")
    (model / "tokenizer.json").write_text("{}")
    train, inputs = local.local_train_config(args, workdir / "runs" / "1")
    assert train["model"]["name_or_path"] == str(model) and inputs.model is None and inputs.chats is None
    assert local_inputs(train, cwd=workdir) == {"data.path": workdir / "mychats.jsonl", "model.name_or_path": model}


def test_the_demo_without_overrides_makes_its_model_and_chats(tmp_path):
    inputs = demo.plan_demo_inputs(tmp_path, preset_name="demo-cpu", overrides=["steps=20"])
    assert inputs.fields == {"model.name_or_path", "data.path"} and inputs.chats == tmp_path / "chat.jsonl"
    assert demo.plan_demo_inputs(tmp_path, preset_name="qwen2.5-1.5b", overrides=[]).fields == frozenset()


# --- a worker node whose raylet missed Ray's registration wait is started once more ----------------

_RAY_START = """
import pathlib, sys, time
tries = pathlib.Path(sys.argv[1])
tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
if len(tries.read_text()) <= int(sys.argv[2]):
    print("Exception: " + sys.argv[3], flush=True)
    sys.exit(1)
print("Ray runtime started.", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("index, failures, error, starts", [
    (1, 1, local.REGISTRATION_TIMEOUT_MARK, 2),  # a worker node: once more, then it is up
    (1, 2, local.REGISTRATION_TIMEOUT_MARK, None),  # not a third time
    (0, 1, local.REGISTRATION_TIMEOUT_MARK, None),  # the head: never again
    (1, 1, "some other failure", None),  # another failure: never again
])
def test_a_worker_node_that_missed_rays_registration_wait_is_started_once_more(tmp_path, monkeypatch, index,
                                                                                failures, error, starts):
    tries = tmp_path / "tries"
    monkeypatch.setattr(local, "_node_argv", lambda **kw: [sys.executable, "-c", _RAY_START, str(tries),
                                                           str(failures), error])
    monkeypatch.setattr(local, "_wait_http", lambda *a, **kw: None)
    nodes = local.LocalNodes(local.LocalClusterSpec(nodes=1, start_timeout_s=20), token="t", log_dir=tmp_path,
                             temp_dir=tmp_path)
    try:
        if starts is None:
            with pytest.raises(RuntimeError, match=f"exited with 1 while starting:\n.*{error}"):
                nodes.start(index)
        else:
            nodes.start(index)
            assert nodes.procs[index].poll() is None
        assert len(tries.read_text()) == (starts or min(failures, 1 if index == 0 or "other" in error else 2))
    finally:
        nodes.stop_all()


# --- the local cluster's start is told node by node ------------------------------------------------


def test_each_node_of_the_local_cluster_is_told_once_it_is_up(tmp_path, monkeypatch):
    monkeypatch.setattr(local.LocalNodes, "start", lambda self, index: time.sleep(0.01))
    monkeypatch.setattr(local.LocalNodes, "stop_all", lambda self: None)
    said: list[str] = []
    with local.local_ray_cluster(local.LocalClusterSpec(nodes=2), log_dir=tmp_path, say=said.append):
        pass
    assert said == ["the head is up (0 s)", "worker node 1 is up (0 s)", "worker node 2 is up (0 s)"]
