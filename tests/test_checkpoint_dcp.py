"""Checkpoints: save and load of an FSDP2-sharded model, its optimizer and the progress counters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from workloads.train import checkpoint
from workloads.train.config import preset
from workloads.train.data import SyntheticSource, batches
from workloads.train.loop import build_model
from workloads.train.step import train_step
from workloads.train.optim import build_optimizer
from workloads.train.parallel import parallelize


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_model_and_optimizer():
    cfg = preset("demo-cpu")
    model, _ = build_model(cfg, device=torch.device("cpu"))
    model = parallelize(
        model,
        mesh=init_device_mesh("cpu", (1,)),
        compile=False,
        mixed_precision=False,
        reshard_after_forward=True,
    )
    return cfg, model, build_optimizer(model, cfg, device=torch.device("cpu"))


def snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(optimizer.state.values()):
        out |= {
            f"s{i}.{k}": v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
            for k, v in state.items()
        }
    return out


def test_load_restores_weights_optimizer_state_and_progress(one_rank_group, tmp_path):
    _, model, optimizer = sharded_model_and_optimizer()
    data = batches(
        SyntheticSource(vocab_size=512, seq_len=16, seed=0), position=0, micro_batch=2, rank=0, world_size=1
    )
    train_step(model, optimizer, [next(data)], lr=1e-2, grad_clip=1.0)
    saved = snapshot(model, optimizer)
    folder = checkpoint.save(
        tmp_path / "ckpt",
        model=model,
        optimizer=optimizer,
        progress=checkpoint.Progress(step=7, data_position=112),
    )

    _, fresh_model, fresh_optimizer = sharded_model_and_optimizer()
    train_step(
        fresh_model, fresh_optimizer, [next(data)], lr=5e-2, grad_clip=1.0
    )  # different weights and state
    progress = checkpoint.load(folder, model=fresh_model, optimizer=fresh_optimizer)

    assert progress == checkpoint.Progress(step=7, data_position=112)
    restored = snapshot(fresh_model, fresh_optimizer)
    assert saved.keys() == restored.keys() and any(k.endswith("exp_avg") for k in saved)
    for key, value in saved.items():
        assert torch.equal(restored[key], value), key


def test_what_a_resume_reads_is_kept_beside_the_shards(one_rank_group, tmp_path):
    _, model, optimizer = sharded_model_and_optimizer()
    commits = {"model:Qwen/Qwen2.5-1.5B": "a1" * 20, "dataset:HuggingFaceH4/ultrachat_200k": "c3" * 20}
    saved = checkpoint.Progress(step=3, data_position=48, world_size=4, tracking_run_id="0a1b2c",
                                planned_world_size=8, hub_revisions=commits)
    folder = checkpoint.save(tmp_path / "ckpt", model=model, optimizer=optimizer, progress=saved)
    assert checkpoint.read_progress(folder) == {"step": 3, "data_position": 48, "world_size": 4,
                                                "tracking_run_id": "0a1b2c", "method": "full",
                                                "planned_world_size": 8, "hub_revisions": commits,
                                                "eval_loss": None}
    assert checkpoint.load(folder, model=model, optimizer=optimizer) == saved
    # A checkpoint from before progress.json existed loads as one that recorded none of it (a full
    # fine-tune's).
    (folder / checkpoint.PROGRESS_FILE).unlink()
    assert checkpoint.load(folder, model=model, optimizer=optimizer) == checkpoint.Progress(step=3, data_position=48)


def test_loading_a_folder_that_is_not_a_checkpoint_is_a_clear_error(one_rank_group, tmp_path):
    _, model, optimizer = sharded_model_and_optimizer()
    with pytest.raises(ValueError, match=r"not a torch\.distributed\.checkpoint folder"):
        checkpoint.load(tmp_path, model=model, optimizer=optimizer)


def test_checkpoint_folders_sort_by_step(tmp_path):
    names = [checkpoint.checkpoint_dir(tmp_path, step=s).name for s in (9, 10, 200)]
    assert names == sorted(names)


def test_checkpoint_keys_do_not_depend_on_compile(one_rank_group):
    """A run may resume with torch.compile switched on or off: the compiled wrapper's `_orig_mod`
    never reaches the checkpoint's keys (compilation itself is lazy, so this costs nothing)."""
    keys = {}
    for compiled in (False, True):
        model, _ = build_model(preset("demo-cpu"), device=torch.device("cpu"))
        parallelize(
            model,
            mesh=init_device_mesh("cpu", (1,)),
            compile=compiled,
            mixed_precision=False,
            reshard_after_forward=True,
        )
        keys[compiled] = set(get_model_state_dict(model))
    assert keys[True] == keys[False]
    assert "lm.model.layers.0.self_attn.q_proj.weight" in keys[True]


def test_a_restore_refuses_a_checkpoint_whose_metadata_points_outside_its_folder(one_rank_group, tmp_path):
    """Any job may write under the bucket's prefix: a checkpoint's `.metadata` that names a file
    outside the folder (here a copy of the shard beside it) is refused before anything is read."""
    import pickle
    import shutil

    from workloads.model_io.safe_checkpoint import read_checkpoint_metadata

    _, model, optimizer = sharded_model_and_optimizer()
    folder = checkpoint.save(tmp_path / "ckpt", model=model, optimizer=optimizer,
                             progress=checkpoint.Progress(step=3, data_position=6))
    metadata = read_checkpoint_metadata(folder)
    for info in metadata.storage_data.values():
        shutil.copy2(folder / info.relative_path, tmp_path / info.relative_path)
        info.relative_path = f"../{info.relative_path}"
    with (folder / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    _, fresh_model, fresh_optimizer = sharded_model_and_optimizer()
    with pytest.raises(ValueError, match=r"points outside the checkpoint .*refused the key '\.\./"):
        checkpoint.load(folder, model=fresh_model, optimizer=fresh_optimizer)
