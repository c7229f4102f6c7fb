"""`python -m workloads export` writes nothing outside the folder it writes to and reads nothing
outside the checkpoint it exports, whatever keys a job put in the bucket or links it left in a run
folder: a key with `..` (S3 keeps it as written; pyarrow's client reads the key it normalizes to),
an absolute key, a symbolic link in a local run folder or in the destination."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from moto_s3 import moto_s3  # noqa: F401  (a fixture)
from safetensors.torch import load_file

from workloads.client import export as export_cli
from workloads.model_io.toy import write_toy_model

BUCKET = "keys"
ATTACK = b"echo pwned\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint folder of the toy model as the loop saves one (its tensors under `model.lm.`),
    carrying its run's export in model/: what export copies, or consolidates with --from-shards."""
    folder = tmp_path_factory.mktemp("ckpt") / "checkpoint-0000002"
    toy = write_toy_model(folder.parent / "toy")
    weights = load_file(toy / "model.safetensors")
    dcp.save({f"model.lm.{name}": tensor for name, tensor in weights.items()}, checkpoint_id=str(folder),
             no_dist=True)
    shutil.copytree(toy, folder / "model")
    return folder


def _upload(client, folder: Path, prefix: str) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder).as_posix()}")


@pytest.fixture(scope="module")
def bucket(moto_s3):
    moto_s3.create_bucket(Bucket=BUCKET)
    return moto_s3


def _plant(client, key: str) -> None:
    """The key as the job wrote it, and the key pyarrow's S3 client reads for it (`..` resolved)."""
    parts: list[str] = []
    for part in key.split("/"):
        if part == "..":
            parts.pop()
        else:
            parts.append(part)
    for name in (key, "/".join(parts)):
        client.put_object(Bucket=BUCKET, Key=name, Body=ATTACK)


def test_an_s3_key_with_dotdot_writes_nothing_outside_the_out_folder(bucket, checkpoint, tmp_path, capsys):
    _upload(bucket, checkpoint, "ray-train/climb/checkpoint-0000002")
    evil = "ray-train/climb/checkpoint-0000002/model/../victim/.bashrc"
    _plant(bucket, evil)
    out = tmp_path / "out"
    code = export_cli.main("export", [f"s3://{BUCKET}/ray-train/climb", "--out", str(out)])
    assert not (tmp_path / "victim" / ".bashrc").exists()
    err = capsys.readouterr().err
    assert code == export_cli.EXIT_USAGE, err
    assert err.count("\n") == 1
    assert "ray-train/climb: refused the key 'checkpoint-0000002/model/../victim/.bashrc'" in err
    assert not out.exists() or not any(out.rglob("*"))  # checked before anything is written


def test_a_key_that_climbs_out_of_the_download_folder_is_refused_before_it_is_written(
        bucket, checkpoint, tmp_path, capsys):
    """--from-shards downloads the checkpoint into a temporary folder first; the keys climb out of it
    to an absolute path, from a checkpoint deep enough that the key pyarrow reads stays in the bucket."""
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    run = "ray-train/deep/" + "d/" * 45 + "checkpoint-0000002"
    _upload(bucket, checkpoint, run)
    evil = f"{run}/" + "../" * 40 + str(victim).lstrip("/")
    _plant(bucket, evil)
    code = export_cli.main("export", [f"s3://{BUCKET}/ray-train/deep", "--from-shards"])
    assert not victim.exists()
    err = capsys.readouterr().err
    assert code == export_cli.EXIT_USAGE and "refused the key" in err and "'..' climbs out" in err


def test_an_absolute_key_is_refused(bucket, checkpoint, tmp_path, capsys):
    _upload(bucket, checkpoint, "ray-train/abs/checkpoint-0000002")
    bucket.put_object(Bucket=BUCKET, Key="ray-train/abs/checkpoint-0000002/model//etc/cron.d/x", Body=ATTACK)
    code = export_cli.main("export", [f"s3://{BUCKET}/ray-train/abs", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == export_cli.EXIT_USAGE and "refused the key 'checkpoint-0000002/model//etc/cron.d/x'" in err


def _local_run(checkpoint: Path, root: Path) -> Path:
    run = root / "run"
    shutil.copytree(checkpoint, run / "checkpoint-0000002")
    return run


@pytest.mark.parametrize("how", [[], ["--from-shards"]], ids=["copied", "consolidated"])
def test_a_link_in_a_local_run_folder_is_not_followed_to_read(checkpoint, tmp_path, capsys, how):
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = do-not-copy\n")
    run = _local_run(checkpoint, tmp_path)
    (run / "checkpoint-0000002" / "model" / "tokenizer.json").unlink()
    (run / "checkpoint-0000002" / "model" / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    code = export_cli.main("export", [str(run), "--out", str(out), *how])
    err = capsys.readouterr().err
    assert code == export_cli.EXIT_USAGE, err
    assert "refused the key 'tokenizer.json'" in err and "symbolic link" in err
    assert not any("do-not-copy" in p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())


def test_a_link_where_the_export_goes_is_not_followed_to_write(checkpoint, tmp_path, capsys):
    victim = tmp_path / "autostart"
    victim.mkdir()
    run = _local_run(checkpoint, tmp_path)
    (run / "model").symlink_to(victim)  # the default --out: model/ next to the checkpoints
    code = export_cli.main("export", [str(run)])
    err = capsys.readouterr().err
    assert code == export_cli.EXIT_USAGE, err
    assert "refused the key 'model'" in err and "symbolic link" in err
    assert list(victim.iterdir()) == []


def test_chat_does_not_follow_a_link_in_place_of_a_runs_model(tmp_path, capsys, monkeypatch):
    import io
    import sys

    from workloads.client import chat as chat_cli

    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    other = write_toy_model(tmp_path / "elsewhere")
    run = tmp_path / "runs" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "model").symlink_to(other)
    code = chat_cli.main("chat", ["r1", "--runs-dir", str(tmp_path / "runs"), "--max-new-tokens", "1"])
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("chat: error: ")]
    assert code == chat_cli.EXIT_USAGE and "refused the key 'model'" in error and "symbolic link" in error
