"""The topology benchmark: machine layouts, the run plan, exposed-communication arithmetic, the
report built from raw records, and (slow) the whole command on CPU with gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from workloads.bench.profile import communication, covered, exposed, merged
from workloads.bench.topology import Layout, RunSpec, Spec, job_config, layout_for, plan_runs
from workloads.bench.topology_report import EMULATED, ONE_HOST, build_document, format_document


@pytest.mark.parametrize(
    ("gpus", "per_host", "shared", "host0", "host1", "one_host"),
    [
        (1, 1, True, "0", "0", "0"),  # both hosts' ranks on the one GPU
        (2, 1, False, "0", "1", "0,1"),
        (4, 2, False, "0,1", "2,3", "0,1,2,3"),
        (8, 4, False, "0,1,2,3", "4,5,6,7", "0,1,2,3,4,5,6,7"),  # the g6.12xlarge pair's shape
    ],
)
def test_layouts_split_the_gpus_into_two_hosts(gpus, per_host, shared, host0, host1, one_host):
    layout = layout_for(gpus)
    assert (layout.gpus_per_host, layout.shared) == (per_host, shared)
    assert (layout.devices(0), layout.devices(1), layout.devices(None)) == (host0, host1, one_host)
    assert layout.one_host_ranks == (1 if shared else 2 * per_host)
    assert bool(layout.limits()) == shared


def test_layout_errors_name_the_fix():
    with pytest.raises(ValueError, match="--cpu"):
        layout_for(0)
    with pytest.raises(ValueError, match="two hosts need 6 GPUs"):
        layout_for(4, gpus_per_host=3)
    assert layout_for(4, gpus_per_host=1).devices(1) == "1"
    assert layout_for(0, cpu=True).devices(0) == ""


def test_every_comparison_trains_on_the_same_tokens_per_optimizer_step():
    for layout in (layout_for(2), layout_for(1), layout_for(8)):
        runs = plan_runs(layout, grad_accum_steps=8)
        emulated = {r.label: r for r in runs[EMULATED]}
        one_host = {r.label: r for r in runs[ONE_HOST]}
        assert list(emulated) == ["auto", "flat", "hsdp-fp32", "flat-k1", "auto-k1"]
        ranks = 2 * layout.gpus_per_host
        for k, one in (("auto", "one-host"), ("auto-k1", "one-host-k1")):
            assert ranks * emulated[k].grad_accum_steps == layout.one_host_ranks * one_host[one].grad_accum_steps
        assert emulated["flat"].grad_accum_steps == emulated["auto"].grad_accum_steps == 8
    assert [r.label for r in plan_runs(layout_for(2), grad_accum_steps=4, skip_k1=True)[EMULATED]] == [
        "auto", "flat", "hsdp-fp32"]


def test_job_configs_apply_each_runs_strategy():
    spec = Spec(preset="qwen2.5-1.5b", micro_batch=16, grad_accum_steps=8, seq_len=2048, steps=7, warmup=2, lr=1e-4)
    flat = job_config(spec, RunSpec(label="flat", overrides=("parallelism=fsdp", "cross_node_reduce_dtype=float32"),
                                    grad_accum_steps=8))
    auto = job_config(spec, RunSpec(label="auto", overrides=(), grad_accum_steps=8))
    assert (flat.parallelism, flat.cross_node_reduce_dtype) == ("fsdp", "float32")
    assert (auto.parallelism, auto.cross_node_reduce_dtype) == ("auto", "bfloat16")
    for cfg in (flat, auto):
        assert (cfg.micro_batch, cfg.grad_accum_steps, cfg.checkpoint_every, cfg.transport.enabled) == (16, 8, 0, False)
        assert cfg.mixed_precision and cfg.compile and cfg.log_every == 1
    with pytest.raises(ValueError, match="parallelism"):
        job_config(spec, RunSpec(label="bad", overrides=("parallelism=ddp",), grad_accum_steps=1))


def test_exposed_communication_is_what_no_other_kernel_overlaps():
    assert merged([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert covered([(0, 1), (0.5, 2)]) == 2
    comm = [(0, 4), (6, 8)]
    other = [(1, 2), (3, 7), (7.5, 9)]
    # Busy alone: 0-1, 2-3 and 7-7.5.
    assert exposed(comm, other) == pytest.approx(2.5)
    assert exposed(comm, []) == 6 and exposed([], other) == 0


def test_communication_reads_nccl_kernels_from_profiler_events():
    def event(name, start_us, end_us, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us))

    events = [
        event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, 400_000),
        event("nvjet_sm90_tst_256x128", 100_000, 300_000),
        event("aten::mm", 0, 1_000_000, device=DeviceType.CPU),  # host side: ignored
    ]
    result = communication(events, steps=2)
    assert result.comm_s == pytest.approx(0.2) and result.exposed_s == pytest.approx(0.1)


def synthetic_run(label: str, *, step_s: float, k: int, parallelism: str, losses: list[float], mb: int = 4,
                  cross: str = "bfloat16", exposed_s: float | None = None) -> dict:
    config = job_config(
        Spec(preset="demo-cpu", micro_batch=mb, grad_accum_steps=k, seq_len=32, steps=5, warmup=1, lr=1e-3),
        RunSpec(label=label, overrides=(f"cross_node_reduce_dtype={cross}",), grad_accum_steps=k),
    ).to_dict()
    config["mixed_precision"] = True
    return {
        "strategy": label, "micro_batch": mb, "status": "ok", "grad_accum_steps": k,
        "tokens_per_step_per_gpu": mb * k * 32, "step_seconds": {str(s): step_s for s in range(2, 6)},
        "losses": {str(i + 1): v for i, v in enumerate(losses)}, "peak_mem_gib": None, "config": config,
        "communication": None if exposed_s is None else {"comm_s": 2 * exposed_s, "exposed_s": exposed_s, "steps": 1},
        # The loop's summary on an H200 names the peak its MFU is against.
        "loop_metrics": [{"summary": {"flops_per_token": 1e6, "parallelism": {"kind": parallelism},
                                      "peak_flops": 989e12}}],
    }


def synthetic_document(layout: Layout) -> dict:
    curve = [6.0, 5.9, 5.8, 5.7, 5.6]
    phases = {
        EMULATED: {"environment": {"device": "test"}, "bandwidth": [
            {"size_bytes": 2**20, "busbw_gbps": 1.0}, {"size_bytes": 2**26, "busbw_gbps": 2.0}], "runs": [
            synthetic_run("flat", step_s=2.0, k=4, parallelism="fsdp", losses=curve, cross="float32", exposed_s=1.0),
            synthetic_run("auto", step_s=0.8, k=4, parallelism="hsdp", losses=[v * 1.0002 for v in curve]),
            {"strategy": "hsdp-fp32", "micro_batch": 4, "status": "error", "error": "RuntimeError: boom",
             "grad_accum_steps": 4, "step_seconds": {}, "losses": {}, "tokens_per_step_per_gpu": 512},
        ]},
        ONE_HOST: {"environment": {}, "bandwidth": [{"size_bytes": 2**20, "busbw_gbps": 100.0}], "runs": [
            synthetic_run("one-host", step_s=0.7, k=4 * layout.ranks_per_gpu, parallelism="fsdp", losses=curve),
        ]},
    }
    spec = {"preset": "demo-cpu", "micro_batch": 4, "grad_accum_steps": 4, "seq_len": 32, "steps": 5, "warmup": 1,
            "lr": 1e-3, "runs": {EMULATED: [{"label": "flat"}, {"label": "auto"}], ONE_HOST: [{"label": "one-host"}]},
            "bandwidth_sizes": [2**20], "overrides": []}
    return build_document(spec=spec, layout=vars(layout) | {}, limits=layout.limits(), phases=phases,
                          exits={EMULATED: {"host0": 0, "host1": 0}}, transport={}, wall_s=1.0)


def test_the_report_compares_against_flat_and_one_host_at_equal_tokens():
    doc = synthetic_document(Layout(gpus=2, gpus_per_host=1, shared=False))
    assert doc["settings"]["emulated_hosts"] == 2 and doc["settings"]["gpus_per_host"] == 1
    by_label = {c["candidate"] + "/" + c["baseline"]: c for c in doc["comparisons"]}
    assert "vs flat" in by_label["auto/flat"]["label"] and by_label["auto/flat"]["ratio"] == pytest.approx(2.5)
    assert "vs one host" in by_label["auto/one-host"]["label"]
    assert by_label["auto/one-host"]["ratio"] == pytest.approx(0.7 / 0.8)
    assert by_label["auto/one-host"]["tokens_per_optimizer_step"] == 2 * 4 * 4 * 32
    targets = {t["target"].split(" (")[0]: t for t in doc["targets"]}
    assert targets["the default on 2 emulated hosts >= 85% of one host"]["met"] is True
    assert targets["the default >= 1.9x flat FSDP"]["met"] is True
    assert targets["loss curve of the default within 0.1% of flat FSDP's at every step"]["value"] == pytest.approx(2e-4)
    predicted = {p["label"]: p for p in doc["model"]["predictions"]}
    assert doc["model"]["calibrated_on"] == "one-host" and predicted["one-host"]["calibration"]
    assert predicted["one-host"]["predicted_step_s"] == pytest.approx(0.7, rel=0.02)  # it predicts itself
    assert predicted["flat"]["measured_exposed_comm_s"] == 1.0
    # The flat run crosses the slow link with more bytes than the default: the model says so too.
    assert predicted["flat"]["predicted_step_s"] > predicted["auto"]["predicted_step_s"]
    assert "hsdp-fp32" not in predicted and not any(c["candidate"] == "hsdp-fp32" for c in doc["comparisons"])
    table = format_document(doc)
    assert "vs flat" in table and "[met]" in table and "hsdp-fp32" in table and " error " in table


def test_on_one_shared_gpu_the_report_says_what_cannot_be_compared():
    doc = synthetic_document(Layout(gpus=1, gpus_per_host=1, shared=True))
    one_host = next(c for c in doc["comparisons"] if c["baseline"] == "one-host")
    assert "no NVLink baseline" in one_host["label"]
    # Two ranks share the GPU: its throughput is both ranks' together.
    assert one_host["ratio"] == pytest.approx((2 * 4 * 4 * 32 / 0.8) / (4 * 8 * 32 / 0.7))
    nvlink = next(t for t in doc["targets"] if "85%" in t["target"])
    assert nvlink["met"] is None and "not comparable" in nvlink["note"]
    assert any("NVLink" in line for line in doc["limits"])


@pytest.mark.slow
def test_the_command_runs_on_cpu_and_writes_a_few_files(tmp_path):
    out = tmp_path / "topology"
    proc = subprocess.run(
        [sys.executable, "-m", "workloads.bench.topology", "--cpu", "--out", str(out), "--preset", "demo-cpu",
         "--seq-len", "32", "--micro-batch", "2", "--grad-accum-steps", "2", "--steps", "4", "--warmup", "1",
         "--skip-k1", "--time-limit", "400"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["bench.json", "emulated-host0.log", "emulated-host1.log", "one-host.log", "table.txt"]
    doc = json.loads((out / "bench.json").read_text())
    assert (doc["settings"]["emulated_hosts"], doc["settings"]["gpus_per_host"]) == (2, 1)
    kinds = {f["label"]: f["parallelism"]["kind"] for f in doc["figures"]}
    assert kinds == {"one-host": "fsdp", "auto": "hsdp", "flat": "fsdp", "hsdp-fp32": "hsdp"}
    labels = [c["label"] for c in doc["comparisons"]]
    assert any("vs flat" in label for label in labels) and any("vs one host" in label for label in labels)
    assert all(c["ratio"] > 0 for c in doc["comparisons"])
    # fp32 on CPU: HSDP and flat FSDP compute the same sums in other orders.
    gap = next(t for t in doc["targets"] if t["target"].startswith("loss curve"))
    assert gap["value"] < 1e-5
    assert "[topology] auto: ok" in proc.stdout and "vs flat" in (out / "table.txt").read_text()
