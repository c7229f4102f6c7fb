"""A model out: the trained weights, written as a Hugging Face folder at the end of a run or
consolidated from any checkpoint (local or in S3), load back with from_pretrained exactly and
generate; `python -m workloads export` finds the run, local, s3:// or by stack and run name."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
from moto_s3 import moto_s3  # noqa: F401  (a fixture)
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from workloads.client import export as export_cli
from workloads.context import TrainContext
from workloads.model_io.export import consolidate, greedy_generate
from workloads.model_io.hf_writer import SafetensorsWriter
from workloads.model_io.toy import toy_conversations, write_chat_jsonl, write_toy_model
from workloads.train.config import preset, with_overrides
from workloads.train.data import batches, build_data
from workloads.train.loop import (
    build_model,
    load_weights,
    mesh_plan,
    model_metadata,
    save_checkpoint,
    shard_model,
)
from workloads.train.model import model_config
from workloads.train.optim import build_optimizer
from workloads.train.step import train_step

BUCKET = "runs"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two checkpoints of a short fine-tune of the toy model on toy chats (one rank, FSDP2): step 2
    with `model/` metadata only, step 4 with the run's own export; and the trained weights."""
    root = tmp_path_factory.mktemp("run")
    base = write_toy_model(root / "base")
    chats = write_chat_jsonl(root / "chat.jsonl", toy_conversations(64))
    cfg = with_overrides(preset("demo-cpu"), [f"model.name_or_path={base}", "data.kind=jsonl",
                                              f"data.path={chats}", "seq_len=32", "micro_batch=4"])
    ctx = TrainContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                       report=lambda m, checkpoint_dir=None: None, latest_checkpoint=lambda: None,
                       scratch_dir=root / "out")
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    try:
        data = build_data(cfg.data, seq_len=cfg.seq_len, seed=0, vocab_size=512, model_name_or_path=str(base))
        model, shape = build_model(cfg, device=CPU, pretrained=base)
        model = shard_model(model, cfg, plan=mesh_plan(cfg, ctx=ctx, device=CPU, model=model), device=CPU)
        load_weights(model, base, ctx=ctx, device=CPU, fetch_s=0.0)
        metadata = model_metadata(cfg, config=model_config(cfg.model, pretrained=base), pretrained=base, data=data)
        optimizer = build_optimizer(model, cfg, device=CPU)
        stream = batches(data.train, position=0, micro_batch=4, rank=0, world_size=1)
        for step in range(1, 5):
            train_step(model, optimizer, [next(stream)], lr=1e-2, grad_clip=1.0)
            if step % 2 == 0:
                save_checkpoint(ctx, model=model, optimizer=optimizer, step=step, data_position=4 * step,
                                metadata=metadata, export_weights=step == 4)
        weights = get_model_state_dict(model.lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    finally:
        dist.destroy_process_group()
    return root, {k: v.clone() for k, v in weights.items()}


def assert_same_weights(folder: Path, weights: dict[str, torch.Tensor], *, dtype=torch.float32) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert set(loaded) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor.to(dtype).float()), name


def test_the_runs_own_export_round_trips_exactly_and_generates(trained):
    root, weights = trained
    folder = root / "out" / "checkpoint-0000004" / "model"
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()}
    assert_same_weights(folder, weights)
    base = AutoModelForCausalLM.from_pretrained(root / "base").state_dict()
    assert not torch.equal(base["model.layers.0.mlp.up_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"])
    config = json.loads((folder / "config.json").read_text())
    assert config["use_cache"] is True and config["dtype"] == "float32"
    # Generation stops at the chat template's end of turn.
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] in (2, [2])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_dict=True, return_tensors="pt")
    model = AutoModelForCausalLM.from_pretrained(folder)
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4
    assert isinstance(greedy_generate(folder, "What is the capital of France?", max_new_tokens=4), str)


def test_auto_export_dtype_is_the_one_the_model_was_published_in(tmp_path):
    from workloads.train.data import Data
    from workloads.train.model import causal_lm_on_meta

    base = write_toy_model(tmp_path / "bf16", dtype=torch.bfloat16)
    cfg = with_overrides(preset("demo-cpu"), [f"model.name_or_path={base}"])
    config = model_config(cfg.model, pretrained=base)
    lm = causal_lm_on_meta(config)
    assert next(lm.parameters()).dtype == torch.float32  # trained in fp32 master weights
    data = Data(train=None, eval=None, eval_rows=0, tokenizer=None, end_of_turn=None, stats={})
    assert model_metadata(cfg, config=config, pretrained=base, data=data).dtype == torch.bfloat16
    named = with_overrides(preset("demo-cpu"), [])
    assert model_metadata(named, config=model_config(named.model), pretrained=None, data=data).dtype == torch.float32


def test_any_checkpoint_consolidates_from_its_shards(trained, tmp_path):
    root, weights = trained
    consolidate(root / "out" / "checkpoint-0000004", tmp_path / "fp32")
    assert_same_weights(tmp_path / "fp32", weights)
    consolidated = consolidate(root / "out" / "checkpoint-0000004", tmp_path / "bf16", dtype_choice="bfloat16")
    assert consolidated == torch.bfloat16
    assert_same_weights(tmp_path / "bf16", weights, dtype=torch.bfloat16)
    assert (tmp_path / "bf16" / "tokenizer.json").is_file()


def test_big_models_are_split_into_indexed_files(trained, tmp_path):
    _, weights = trained
    writer = SafetensorsWriter(tmp_path, max_shard_bytes=200_000)
    for name, tensor in weights.items():
        if name != "lm_head.weight":  # tied to the embedding, saved once
            writer.add(name, tensor)
    paths = writer.close()
    assert len(paths) > 1 and paths[0].name == f"model-00001-of-{len(paths):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights) - {"lm_head.weight"}
    (tmp_path / "config.json").write_text((trained[0] / "base" / "config.json").read_text())
    assert_same_weights(tmp_path, weights)


def test_export_command_on_a_local_run(trained, tmp_path, capsys):
    root, weights = trained
    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoint-0000002", "checkpoint-0000004"):  # copies: links in a run folder are not followed
        shutil.copytree(root / "out" / name, run / name)
    assert export_cli.main("export", [str(run)]) == 0
    assert "copied from" in capsys.readouterr().out
    assert_same_weights(run / "model", weights)
    assert export_cli.main("export", [str(run)]) == 2
    assert "already holds files: pass --overwrite" in capsys.readouterr().err
    argv = [str(run), "--checkpoint", "checkpoint-0000002", "--out", str(tmp_path / "two")]
    assert export_cli.main("export", argv) == 0
    assert "consolidated from" in capsys.readouterr().out
    assert export_cli.main("export", [str(run), "--checkpoint", "checkpoint-0000009"]) == 2
    assert ("has no checkpoint 'checkpoint-0000009' (newest: checkpoint-0000002, checkpoint-0000004)"
            in capsys.readouterr().err)
    assert export_cli.main("export", [str(tmp_path / "absent")]) == 2
    assert f"'{tmp_path / 'absent'}' is neither a folder here nor a run of" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert export_cli.main("export", [str(tmp_path / "empty")]) == 2
    assert "nothing is stored there" in capsys.readouterr().err


def _upload(client, folder: Path, prefix: str) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder)}")


def _keys(client, prefix: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {obj["Key"][len(prefix):] for page in pages for obj in page.get("Contents", [])}


@pytest.fixture(scope="module")
def s3_run(trained, moto_s3):
    root, _ = trained
    moto_s3.create_bucket(Bucket=BUCKET)
    _upload(moto_s3, root / "out", "ray-train/tiny-run")
    return moto_s3


def test_export_command_from_s3_to_s3_and_generate(s3_run, capsys):
    out = f"s3://{BUCKET}/exports/tiny"
    argv = [f"s3://{BUCKET}/ray-train/tiny-run", "--out", out, "--from-shards",
            "--generate", "What is the capital of Peru?"]
    assert export_cli.main("export", argv) == 0
    printed = capsys.readouterr().out
    source = f"s3://{BUCKET}/ray-train/tiny-run/checkpoint-0000004"
    assert f"model    {out}  (float32, consolidated from {source})" in printed
    assert "generate 'What is the capital of Peru?' -> " in printed
    exported = {"/model.safetensors", "/config.json", "/tokenizer.json", "/generation_config.json"}
    assert exported <= _keys(s3_run, "exports/tiny")


FAKE_PULUMI = """#!{python}
import json, sys
assert sys.argv[1:4] == ["stack", "output", "--json"], sys.argv
print(json.dumps({outputs}))
"""


def test_export_command_by_stack_and_run_name(s3_run, tmp_path, monkeypatch, capsys):
    outputs = {"kubeconfig": "{}", "clusterName": "c", "region": "us-east-1", "rayNamespace": "ray",
               "rayClusterName": "r", "rayHeadService": "h", "rayDashboardPort": 8265, "rayAuthSecretName": "s",
               "rayAuthSecretKey": "k", "checkpointBucketUri": f"s3://{BUCKET}/ray-train"}
    pulumi = tmp_path / "bin" / "pulumi"
    pulumi.parent.mkdir()
    pulumi.write_text(FAKE_PULUMI.format(python=sys.executable, outputs=repr(outputs)))
    pulumi.chmod(pulumi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{pulumi.parent}{os.pathsep}{os.environ['PATH']}")
    assert export_cli.main("export", ["--stack", "dev", "--run", "tiny-run"]) == 0
    assert f"model    s3://{BUCKET}/ray-train/tiny-run/model  (float32, copied from" in capsys.readouterr().out
    assert "/model.safetensors" in _keys(s3_run, "ray-train/tiny-run/model")
    assert export_cli.main("export", ["--stack", "dev"]) == 2
    assert "give either RUN, or --stack NAME with --run NAME" in capsys.readouterr().err


NO_PYARROW = """
import sys
class NoPyarrow:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pyarrow":
            raise ImportError("pyarrow is not installed here")
sys.meta_path.insert(0, NoPyarrow())
from workloads.client import export
sys.exit(export.main("export", sys.argv[1:]))
"""


def test_a_local_run_exports_on_a_machine_without_pyarrow(trained, tmp_path, repo_root):
    """The GPU hosts have torch and transformers but not Ray, which is what brings pyarrow."""
    import subprocess

    root, weights = trained
    out = tmp_path / "model"
    proc = subprocess.run([sys.executable, "-c", NO_PYARROW, str(root / "out"), "--from-shards", "--out", str(out)],
                          cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert_same_weights(out, weights)
