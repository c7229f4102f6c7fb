"""The base a LoRA export merges into is the run's own, as the client submitted it (the submission
record `submit` and `run --local` keep, or a local run's run.json), never the one the checkpoint's
adapter_config.json names: the job wrote that file, and export fetches the base with the user's
credentials. An adapter that names another base than the run was submitted with is refused; with no
record, export asks for --base; an adapter without a lora_A/lora_B pair is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from moto_s3 import moto_s3  # noqa: F401  (a fixture)
from safetensors.torch import load_file

from workloads.client import export as export_cli
from workloads.model_io.toy import write_toy_model

BUCKET = "lora"
Q = "model.layers.0.self_attn.q_proj"
RANK, ALPHA = 2, 4


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """The base the run trained on, and another of the same shape (other weights)."""
    root = tmp_path_factory.mktemp("bases")
    good = write_toy_model(root / "good")
    evil = write_toy_model(root / "evil", seed=7)
    assert not torch.equal(load_file(good / "model.safetensors")[f"{Q}.weight"],
                           load_file(evil / "model.safetensors")[f"{Q}.weight"])
    return {"good": good, "evil": evil}


def lora_checkpoint(folder: Path, *, base: Path, claims: str, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A LoRA checkpoint as the loop saves one: the adapters under `model.lm.`, and model/ with the
    base's config and tokenizer and the adapter's config, whose base_model_name_or_path is `claims`."""
    weight = load_file(base / "model.safetensors")[f"{Q}.weight"]
    tensors = tensors if tensors is not None else {
        f"model.lm.{Q}.lora_A.default.weight": torch.full((RANK, weight.shape[1]), 0.01),
        f"model.lm.{Q}.lora_B.default.weight": torch.full((weight.shape[0], RANK), 0.02)}
    dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
    (folder / "model" / "adapter").mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file():
            shutil.copy2(base / name, folder / "model" / name)
    (folder / "model" / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj"],
         "base_model_name_or_path": claims, "revision": None}))
    return folder


def local_run(root: Path, *, trained_on: Path, claims: str) -> Path:
    """A `run --local` folder from before submission records: run.json says what it trained on."""
    run = root / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": "r1", "status": "succeeded", "train": {
        "method": "lora", "model": {"name_or_path": str(trained_on), "revision": ""}}}))
    lora_checkpoint(run / "checkpoints" / "r1" / "checkpoint-0000002", base=trained_on, claims=claims)
    return run


def assert_merged_into(out: Path, base: Path) -> None:
    merged, own = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    delta = torch.full((own[f"{Q}.weight"].shape[0], RANK), 0.02) @ torch.full((RANK, own[f"{Q}.weight"].shape[1]),
                                                                                0.01)
    torch.testing.assert_close(merged[f"{Q}.weight"], own[f"{Q}.weight"] + delta * ALPHA / RANK)
    assert torch.equal(merged["model.norm.weight"], own["model.norm.weight"])


def test_an_adapter_naming_another_base_than_the_run_was_submitted_with_is_refused(bases, tmp_path, capsys):
    run = local_run(tmp_path, trained_on=bases["good"], claims=str(bases["evil"]))
    out = tmp_path / "out"
    code = export_cli.main("export", [str(run), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == export_cli.EXIT_USAGE, err
    assert f"names its base {str(bases['evil'])!r}" in err and f"submitted with {str(bases['good'])!r}" in err
    assert not (out / "model.safetensors").exists() and not (out / "adapter").exists()


def test_the_base_comes_from_the_local_runs_record(bases, tmp_path):
    run = local_run(tmp_path, trained_on=bases["good"], claims=str(bases["good"]))
    assert export_cli.main("export", [str(run), "--out", str(tmp_path / "out")]) == export_cli.EXIT_OK
    assert_merged_into(tmp_path / "out", bases["good"])


def test_a_stack_runs_base_comes_from_its_submission_record_as_the_client_sent_it(bases, tmp_path, moto_s3):
    """`submit --stack` uploaded the local base with the job: the config the job got, and so its
    adapter, names it by its place in the job's folder; the record maps it back to this machine's."""
    from workloads.client.run_record import record_submission, submitted_base

    sent = "job_files/model.name_or_path/good"
    record_submission(train={"method": "lora", "model": {"name_or_path": sent, "revision": ""}}, run_name="r2",
                      storage_path=f"s3://{BUCKET}/ray-train", files=((sent, bases["good"]),))
    folder = lora_checkpoint(tmp_path / "checkpoint-0000002", base=bases["good"], claims=sent)
    moto_s3.create_bucket(Bucket=BUCKET)
    for path in folder.rglob("*"):
        if path.is_file():
            moto_s3.upload_file(str(path), BUCKET, f"ray-train/r2/checkpoint-0000002/{path.relative_to(folder)}")
    out = tmp_path / "out"
    assert export_cli.main("export", [f"s3://{BUCKET}/ray-train/r2", "--out", str(out)]) == export_cli.EXIT_OK
    assert_merged_into(out, bases["good"])
    base = submitted_base(f"s3://{BUCKET}/ray-train/r2/checkpoint-0000002")
    assert (base.name_or_path, base.source) == (sent, str(bases["good"]))
    assert submitted_base(f"s3://{BUCKET}/ray-train/r20/checkpoint-0000002") is None  # another run


def test_without_a_record_the_base_is_asked_for_not_taken_from_the_checkpoint(bases, tmp_path, capsys):
    run = tmp_path / "torchrun-out"
    lora_checkpoint(run / "checkpoint-0000002", base=bases["good"], claims=str(bases["evil"]))
    out = tmp_path / "out"
    code = export_cli.main("export", [str(run), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == export_cli.EXIT_USAGE, err
    assert "no record of this run's submission" in err and "--base FOLDER_OR_HUB_ID" in err
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    # The user names the base: merged into it.
    assert export_cli.main("export", [str(run), "--out", str(out), "--overwrite", "--base",
                                      str(bases["good"])]) == export_cli.EXIT_OK
    assert_merged_into(out, bases["good"])


@pytest.mark.parametrize("tensors", [
    {f"model.lm.{Q}.lora_X.default.weight": torch.ones(2, 2)},
    {f"model.lm.{Q}.lora_A.default.weight": torch.ones(RANK, 64)},
], ids=["no-pair", "A-without-B"])
def test_an_adapter_without_a_lora_a_and_b_pair_is_refused(bases, tmp_path, capsys, tensors):
    run = tmp_path / "run"
    lora_checkpoint(run / "checkpoint-0000002", base=bases["good"], claims=str(bases["good"]), tensors=tensors)
    code = export_cli.main("export", [str(run), "--out", str(tmp_path / "out"), "--base", str(bases["good"])])
    err = capsys.readouterr().err
    assert code == export_cli.EXIT_USAGE, err
    assert "lora_A and one lora_B" in err or "holds no LoRA adapters" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_every_submission_is_recorded_on_the_submitting_machine_before_it_is_sent(tmp_path):
    from workloads.client.run_record import records_folder, submitted_base
    from workloads.client.submission import SubmitRequest, submit_job

    class Cluster:
        def submit_job(self, **request):
            assert submitted_base("s3://bkt/ray-train/r3/checkpoint_2026-12-05_10-00-00") is not None
            return "r3-job1"

    train = {"steps": 2, "method": "lora", "model": {"name_or_path": "Qwen/Qwen2.5-1.5B", "revision": "9f1c2e"}}
    submit_job(Cluster(), SubmitRequest(train=train, run_name="r3", storage_path="s3://bkt/ray-train/",
                                        max_failures=1, expect="any", quiet=True))
    base = submitted_base("s3://bkt/ray-train/r3/checkpoint_2026-12-05_10-00-00")
    assert (base.name_or_path, base.revision, base.source) == ("Qwen/Qwen2.5-1.5B", "9f1c2e", "")
    assert base.told_by.startswith(f"the submission record {records_folder()}")
    assert records_folder().stat().st_mode & 0o077 == 0
