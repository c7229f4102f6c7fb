"""Pretrained weights in: from a local folder and from s3:// (a moto server), two gloo ranks build the
model on the meta device, shard it with FSDP2 and fill their shards from the safetensors files; the
gathered state is exactly the saved one. Remote folders are fetched once per node. Unknown hub ids,
an unreachable hub and unreadable S3 prefixes fail at once, with a message saying what to do."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moto_s3 import moto_s3  # noqa: F401  (a fixture)
from safetensors.torch import load_file
from ranks import run_ranks

from workloads.client.cluster import free_port
from workloads.model_io.architectures import named_architecture
from workloads.model_io.sources import LOG_PREFIX, fetch_model

WORLD_SIZE = 2
BUCKET = "models"
# 509 rows do not split evenly over two ranks: the shards' row offsets matter.
VOCAB = 509


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A tiny Qwen2 saved in bf16, as hub checkpoints are (the load upcasts to fp32 master weights)."""
    from transformers import Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("pretrained") / "model"
    torch.manual_seed(1)
    Qwen2ForCausalLM(named_architecture("tiny-qwen2", vocab_size=VOCAB)).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def s3(saved_model, moto_s3):
    """The model under s3://models/qwen/tiny/ (the spawned ranks inherit the environment reaching it)."""
    moto_s3.create_bucket(Bucket=BUCKET)
    for path in saved_model.iterdir():
        moto_s3.upload_file(str(path), BUCKET, f"qwen/tiny/{path.name}")
    moto_s3.put_object(Bucket=BUCKET, Key="qwen/no-config/model.safetensors", Body=b"x")
    return moto_s3


def worker(rank: int, port: int, sources: dict[str, str], cache: Path, out: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from workloads.train.config import ModelConfig, TrainConfig
    from workloads.train.loop import build_model
    from workloads.train.model import load_pretrained
    from workloads.train.parallel import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        for name, source in sources.items():
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                folder = fetch_model(source, cache_dir=str(cache))
            cfg = TrainConfig(model=ModelConfig(name_or_path=source))
            model, _ = build_model(cfg, device=torch.device("cpu"), pretrained=folder)
            assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated yet
            parallelize(model, mesh=init_device_mesh("cpu", (WORLD_SIZE,)), compile=False, mixed_precision=False,
                        reshard_after_forward=True)
            stats = load_pretrained(model.lm, folder, device=torch.device("cpu"))
            full = get_model_state_dict(model.lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(full, out / f"{name}.pt")
            (out / f"{name}-rank{rank}.json").write_text(json.dumps(
                {"stdout": printed.getvalue(), "bytes_read": stats.bytes_read, "folder": str(folder)}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def loaded(saved_model, s3, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    out = tmp_path_factory.mktemp("loaded")
    sources = {"local": str(saved_model), "s3": f"s3://{BUCKET}/qwen/tiny"}
    run_ranks(worker, args=(free_port(), sources, out / "cache", out), nprocs=WORLD_SIZE)
    return out, sources


@pytest.mark.slow
@pytest.mark.parametrize("source", ["local", "s3"])
def test_sharded_load_gives_exactly_the_saved_weights(loaded, saved_model, source):
    out, _ = loaded
    full = torch.load(out / f"{source}.pt")
    saved = load_file(saved_model / "model.safetensors")
    assert set(saved) <= set(full) and full["model.embed_tokens.weight"].shape[0] == VOCAB
    for name, tensor in saved.items():
        assert full[name].dtype == torch.float32, name
        assert torch.equal(full[name], tensor.float()), name
    assert torch.equal(full["lm_head.weight"], saved["model.embed_tokens.weight"].float())  # tied
    # Each rank read only its own shards: together, the file's tensors once.
    read = [json.loads((out / f"{source}-rank{r}.json").read_text())["bytes_read"] for r in range(WORLD_SIZE)]
    assert sum(read) == sum(t.numel() * t.element_size() for t in saved.values()) and min(read) > 0


@pytest.mark.slow
def test_an_s3_model_is_downloaded_once_per_node(loaded):
    out, _ = loaded
    ranks = [json.loads((out / f"s3-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    downloads = [line for r in ranks for line in r["stdout"].splitlines() if "downloading" in line]
    assert len(downloads) == 1 and downloads[0].startswith(LOG_PREFIX)
    assert ranks[0]["folder"] == ranks[1]["folder"]
    assert not any("downloading" in json.loads((out / f"local-rank{r}.json").read_text())["stdout"]
                   for r in range(WORLD_SIZE))


# --- clear, fast failures ------------------------------------------------------------------------


class _NotFound(BaseHTTPRequestHandler):
    """The hub API's answer for a repository that does not exist."""

    def do_GET(self):  # noqa: N802
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    do_HEAD = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def hub_without_the_model():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_an_unknown_hub_id_fails_at_once(hub_without_the_model, tmp_path):
    started = time.monotonic()
    missing = r"hub model 'no-such-org/no-such-model' does not exist on the Hugging Face hub"
    with pytest.raises(ValueError, match=missing):
        fetch_model("no-such-org/no-such-model", cache_dir=str(tmp_path), endpoint=hub_without_the_model)
    assert time.monotonic() - started < 10
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]  # no half-made cache entry


def test_an_unreachable_hub_fails_at_once(tmp_path):
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"cannot reach the Hugging Face hub for hub model 'Qwen/Qwen2.5-1.5B'"):
        fetch_model("Qwen/Qwen2.5-1.5B", cache_dir=str(tmp_path), endpoint=f"http://127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("s3://no-such-bucket/qwen", r"s3://no-such-bucket/qwen"),
        (f"s3://{BUCKET}/nothing-here", r"nothing is stored under that prefix"),
        (f"s3://{BUCKET}/qwen/no-config", r"holds no config.json and .safetensors weights"),
    ],
)
def test_an_unreadable_s3_prefix_is_named(s3, tmp_path, uri, match):
    with pytest.raises(ValueError, match=match):
        fetch_model(uri, cache_dir=str(tmp_path))


def test_local_folders_that_are_not_models_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"has no config.json"):
        fetch_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no .safetensors weights"):
        fetch_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"neither an existing local path, an s3:// URI nor a Hugging Face hub id"):
        fetch_model("not a model!")


def test_training_stops_before_its_first_step_on_an_unknown_model(hub_without_the_model, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from workloads.context import TrainContext
    from workloads.train.config import preset, with_overrides
    from workloads.train.loop import train

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub_without_the_model)
    cfg = with_overrides(preset("demo-cpu"), ["model.name_or_path=no-such-org/no-such-model",
                                              f"cache_dir={tmp_path / 'cache'}"])
    reports: list = []
    ctx = TrainContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                       report=lambda m, checkpoint_dir=None: reports.append(m), latest_checkpoint=lambda: None,
                       scratch_dir=tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="does not exist on the Hugging Face hub"):
            train(cfg, ctx)
    finally:
        dist.destroy_process_group()
    assert reports == []


def test_a_hub_datasets_split_is_found_by_the_hubs_file_names():
    from workloads.model_io.sources import split_files

    names = ["README.md", "data/train_sft-00000-of-00003-a3.parquet", "data/train_sft-00001-of-00003-0a.parquet",
             "data/test_sft-00000-of-00001-f7.parquet", "data/train_gen-00000-of-00003-a6.parquet",
             "default/train/0000.parquet", "train.jsonl", "train_sft_notes.txt"]
    assert split_files(names, split="train_sft") == ["data/train_sft-00000-of-00003-a3.parquet",
                                                      "data/train_sft-00001-of-00003-0a.parquet"]
    assert split_files(names, split="train") == ["default/train/0000.parquet", "train.jsonl"]
    assert split_files(names, split="validation") == []


def test_compiled_layers_load_and_export_under_their_file_names(saved_model, tmp_path):
    """The GPU presets compile each decoder layer, which puts `_orig_mod.` into parameter names;
    neither the load nor the export may see it (compilation is lazy: nothing compiles here)."""
    from torch.distributed.device_mesh import init_device_mesh

    from workloads.model_io.export import write_weights_from_shards
    from workloads.train.config import ModelConfig, TrainConfig
    from workloads.train.loop import build_model
    from workloads.train.model import load_pretrained
    from workloads.train.parallel import parallelize

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, _ = build_model(TrainConfig(model=ModelConfig(name_or_path=str(saved_model))),
                               device=torch.device("cpu"), pretrained=saved_model)
        parallelize(model, mesh=init_device_mesh("cpu", (1,)), compile=True, mixed_precision=False,
                    reshard_after_forward=True)
        assert any("_orig_mod." in name for name, _ in model.lm.named_parameters())
        load_pretrained(model.lm, saved_model, device=torch.device("cpu"))
        write_weights_from_shards(model.lm, tmp_path / "out", dtype=torch.bfloat16, writer_rank=True)
    finally:
        dist.destroy_process_group()
    saved, written = load_file(saved_model / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert written.keys() == saved.keys()
    assert all(torch.equal(written[k], saved[k]) for k in saved)  # bf16 in, fp32 master, bf16 out: exact


def test_an_s3_data_file_is_fetched_into_the_node_cache(s3, tmp_path):
    from workloads.model_io.sources import fetch_data_file

    s3.put_object(Bucket=BUCKET, Key="inputs/chats.jsonl", Body=b'{"text": "hello"}\n')
    first = fetch_data_file(f"s3://{BUCKET}/inputs/chats.jsonl", cache_dir=str(tmp_path))
    assert first.read_bytes() == b'{"text": "hello"}\n' and tmp_path in first.parents
    assert fetch_data_file(f"s3://{BUCKET}/inputs/chats.jsonl", cache_dir=str(tmp_path)) == first
    with pytest.raises(ValueError, match=r"data.path 's3://models/inputs/nope.jsonl': no such object"):
        fetch_data_file(f"s3://{BUCKET}/inputs/nope.jsonl", cache_dir=str(tmp_path))


def test_materializing_keeps_a_tied_weight_tied_and_the_buffers_values():
    """to_empty gives each module a parameter of its own, which unties a tied weight that is a plain
    tensor (a one-rank LoRA run's frozen base is left out of FSDP2): the load ties it again, or the
    output embedding would be a second, unfilled tensor (`lacks lm_head.weight`)."""
    from torch import nn

    from workloads.model_io.load import materialize, parameters_on_meta

    with parameters_on_meta():
        model = nn.Module()
        model.embed, model.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        model.head.weight = model.embed.weight
        model.other = nn.Linear(4, 4)
    model.register_buffer("scale", torch.arange(3.0))
    assert model.embed.weight.device.type == "meta"
    materialize(model, device=torch.device("cpu"))
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "cpu"
    assert model.other.weight is not model.embed.weight and model.other.bias.device.type == "cpu"
    assert torch.equal(model.scale, torch.arange(3.0))
    assert len(list(model.parameters())) == 3
