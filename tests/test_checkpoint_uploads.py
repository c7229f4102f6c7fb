"""Checkpoints when the run's storage does not answer: a periodic one is tried again, then skipped by
every rank together with a warning while training goes on, and its half-written folder is deleted
once storage answers; the final one fails the attempt rather than end the run without the model.

Two gloo ranks call the Ray adapter's `report` as the loop does, with Ray 2.58's own StorageContext
uploading into a filesystem that fails while a rank's "down" flag is set (an S3 endpoint that does
not answer raises OSError from pyarrow in the same place). `ray.train.report` is replaced by a
recorder of what each rank reported; given an upload function it calls it, as Ray's
`_upload_checkpoint` does, whose error ends the attempt."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import fsspec.implementations.local
import pyarrow.fs
import pytest
import ray.train
import torch.distributed as dist
from ranks import run_ranks

from workloads.client.cluster import free_port
from workloads.launch import ray_train
from workloads.launch.uploads import UnregisteredFolders, UploadPolicy, upload_patiently


class FlakyLocal(fsspec.implementations.local.LocalFileSystem):
    """A local folder that raises OSError, as pyarrow's S3 filesystem does when S3 does not answer,
    while its flag file exists."""

    cachable = False

    def __init__(self, flag: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.flag = flag

    def _down(self) -> None:
        if self.flag.exists():
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation: Could not connect to server")

    def info(self, path, **kwargs):
        self._down()
        return super().info(path, **kwargs)

    def mkdir(self, path, **kwargs):
        self._down()
        return super().mkdir(path, **kwargs)

    def makedirs(self, path, **kwargs):
        self._down()
        return super().makedirs(path, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        self._down()
        return super()._open(path, mode=mode, **kwargs)

    def rm(self, path, **kwargs):
        self._down()
        return super().rm(path, **kwargs)


class FakeContext:
    def __init__(self, rank: int, storage) -> None:
        self.rank, self.storage = rank, storage

    def get_experiment_name(self) -> str:
        return "run"

    def get_world_rank(self) -> int:
        return self.rank

    def get_storage(self):
        return self.storage


def _rank(rank: int, port: int, root: Path, plan: list[dict]) -> None:
    """Report each step of `plan` ({"step", "down": [ranks], "final"}) with a checkpoint; write
    what this rank reported, what it raised and what it printed to root/rank-N.json."""
    from ray.train.v2._internal.execution.storage import StorageContext

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flag = root / f"down-{rank}"
    filesystem = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(FlakyLocal(flag)))
    storage = StorageContext(storage_path=str(root / "storage"), experiment_dir_name="run",
                             storage_filesystem=filesystem)
    reported: list[dict] = []

    def recorded_report(metrics, checkpoint=None, checkpoint_upload_fn=None, **options):
        if checkpoint is not None and checkpoint_upload_fn is not None:
            local = checkpoint.path
            checkpoint = checkpoint_upload_fn(checkpoint, storage.make_default_checkpoint_dir_name())
            if options.get("delete_local_checkpoint_after_upload"):
                shutil.rmtree(local)
        reported.append({"step": metrics["step"], "checkpoint": None if checkpoint is None else checkpoint.path,
                         "mode": str(options.get("checkpoint_upload_mode", ""))})

    ray.train.get_context = lambda: FakeContext(rank, storage)
    ray.train.report = recorded_report
    out, raised = io.StringIO(), {}
    with contextlib.redirect_stdout(out):
        for entry in plan:
            step = entry["step"]
            folder = root / f"local-{rank}" / f"checkpoint-{step}"
            folder.mkdir(parents=True)
            (folder / f"part-{rank}").write_text(f"rank {rank} step {step}")
            if rank in entry["down"]:
                flag.touch()
            try:
                if entry.get("final"):
                    ray_train.report({"step": step}, folder, final_step=step,
                                     policy=UploadPolicy(final_wait_s=0.2, final_pause_s=0.05))
                else:
                    ray_train.report({"step": step}, folder)
            except Exception as exc:  # recorded for the test; the other rank sees the same
                raised[step] = f"{type(exc).__name__}: {exc}"
            finally:
                flag.unlink(missing_ok=True)
    left = sorted(p.name for p in (root / f"local-{rank}").iterdir())
    (root / f"rank-{rank}.json").write_text(json.dumps({"reported": reported, "raised": raised, "left_locally": left,
                                                        "printed": out.getvalue()}))
    dist.destroy_process_group()


def _run(root: Path, plan: list[dict]) -> list[dict]:
    run_ranks(_rank, args=(free_port(), root, plan), nprocs=2)
    return [json.loads((root / f"rank-{rank}.json").read_text()) for rank in range(2)]


def _folders(root: Path) -> dict[str, set[str]]:
    run = root / "storage" / "run"
    return {p.name: {f.name for f in p.iterdir()} for p in sorted(run.glob("checkpoint_*"))}


@pytest.mark.slow
def test_a_checkpoint_storage_refuses_is_skipped_by_every_rank_and_training_goes_on(tmp_path):
    # Step 4: rank 1's part cannot be stored (rank 0's is). Step 6: storage answers again.
    ranks = _run(tmp_path, [{"step": 2, "down": []}, {"step": 4, "down": [1]}, {"step": 6, "down": []}])
    for result in ranks:
        assert result["raised"] == {}, result
        assert result["left_locally"] == []  # stored or skipped, the node's copy is gone
        stored = {r["step"]: r["checkpoint"] for r in result["reported"]}
        # Every rank reports every step; no rank reports step 4's checkpoint (Ray would register it).
        assert sorted(stored) == [2, 4, 6] and stored[4] is None
        assert stored[2] and stored[6] and all("NO_UPLOAD" in r["mode"] for r in result["reported"] if r["checkpoint"])
    assert ranks[0]["reported"] == ranks[1]["reported"]  # the same folders, named by rank 0
    printed = ranks[0]["printed"]
    assert ("[checkpoints] warning: the checkpoint of step 4 could not be stored in " in printed
            and "(1 of 2 ranks; rank 1 after 2 tries: AWS Error NETWORK_CONNECTION" in printed
            and "skipped: training goes on, and a restart resumes from the last checkpoint stored" in printed), printed
    assert "storage answers again: removed the folder(s) of 1 skipped checkpoint(s)" in printed
    assert ranks[1]["printed"] == ""
    # Left in storage: the two stored checkpoints, each with both parts; step 4's folder is gone.
    folders = _folders(tmp_path)
    assert sorted(folders) == sorted(Path(r["checkpoint"]).name for r in ranks[0]["reported"] if r["checkpoint"])
    assert all(files == {"part-0", "part-1"} for files in folders.values())


@pytest.mark.slow
def test_the_final_checkpoint_that_cannot_be_stored_fails_the_attempt_on_every_rank(tmp_path):
    ranks = _run(tmp_path, [{"step": 8, "down": [0, 1], "final": True}])
    for result in ranks:
        assert list(result["raised"]) == ["8"] and "CheckpointNotStoredError" in result["raised"]["8"]
        assert "the final checkpoint holds the trained model" in result["raised"]["8"]
        assert result["reported"] == [] and result["left_locally"] == []
    assert _folders(tmp_path) == {}


def test_a_periodic_upload_is_tried_again_then_given_up():
    pauses: list[float] = []
    calls = iter([OSError("AWS Error NETWORK_CONNECTION\nCould not connect"), "stored"])
    outcome = upload_patiently(lambda: _next(calls), final=False, policy=UploadPolicy(tries=2, pause_s=3),
                               sleep=pauses.append)
    assert (outcome.stored, outcome.tries, pauses) == ("stored", 2, [3])
    failing = iter([OSError("first"), OSError("second"), OSError("third")])
    outcome = upload_patiently(lambda: _next(failing), final=False, policy=UploadPolicy(tries=2, pause_s=3),
                               sleep=pauses.append)
    assert (outcome.stored, outcome.error, outcome.tries) == (None, "second", 2)


def test_the_final_upload_is_tried_until_its_wait_is_spent():
    now = [0.0]
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    def down():
        raise OSError("no answer")

    outcome = upload_patiently(down, final=True, policy=UploadPolicy(final_wait_s=60, final_pause_s=15),
                               sleep=sleep, clock=lambda: now[0])
    assert outcome.stored is None and outcome.tries == 5 and pauses == [15, 15, 15, 15]


def test_an_error_that_is_not_storages_is_not_retried():
    with pytest.raises(TypeError):
        upload_patiently(lambda: _next(iter([TypeError("a bug")])), final=False, sleep=lambda s: None)


def test_skipped_folders_are_deleted_when_storage_answers_and_kept_while_it_does_not(tmp_path):
    flag = tmp_path / "down"
    filesystem = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(FlakyLocal(flag)))
    run = tmp_path / "run"
    (run / "checkpoint_a").mkdir(parents=True)
    (run / "checkpoint_a" / "part-0").write_text("half")
    skipped = UnregisteredFolders()
    skipped.add("checkpoint_a")
    skipped.add("checkpoint_gone")  # never written: nothing to delete
    flag.touch()
    assert skipped.remove(filesystem, str(run)) == [] and skipped.names == ["checkpoint_a", "checkpoint_gone"]
    flag.unlink()
    assert skipped.remove(filesystem, str(run)) == ["checkpoint_a", "checkpoint_gone"] and skipped.names == []
    assert not (run / "checkpoint_a").exists()


def _next(calls):
    value = next(calls)
    if isinstance(value, BaseException):
        raise value
    return value
