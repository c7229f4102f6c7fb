"""`python -m workloads.bench.topology --out DIR`: the loop between nodes, measured on one machine.

First, one torchrun on one host: `one-host` and `one-host-k1`, the default loop over NVLink (the
baseline; its MFU calibrates the step-time model). Then two emulated hosts, as NCCL sees hosts:
one torchrun per host (`--nnodes 2 --node-rank R --master-addr 127.0.0.1`), each with its own GPUs
(`CUDA_VISIBLE_DEVICES`), its own `NCCL_HOSTID` and `NCCL_SOCKET_IFNAME=lo`, so traffic between
them takes NCCL's network transport (sockets on loopback, about the 40 Gbps of a g6.12xlarge's EFA
interface) while each host's own GPUs use NVLink. In that one process group, in order:

  bandwidth   all-reduce bus bandwidth between the hosts (`bench nccl`'s measurement)
  auto        the default: HSDP (shard within a host, replicate across), bf16 between hosts  } K micro-
  flat        today's loop: flat FSDP, fp32 gradient reduction                              } steps, the
  hsdp-fp32   HSDP with fp32 between hosts                                                  } one-host
  flat-k1, auto-k1   the same without accumulation                                           } tokens/step

Every run trains on as many tokens per optimizer step as its one-host counterpart. The last step
of every run is profiled for the communication it left exposed; the step-time model
(workloads/sizing/step_time.py) predicts every run from the measured bandwidths and the one-host
MFU. DIR gets bench.json, table.txt and one log per torchrun.

Machines: with 2N GPUs, two hosts of N GPUs (2 GPUs: 1 per host; 8: the g6.12xlarge pair's 2 x 4).
With one GPU both hosts' ranks share it (NCCL allows two ranks on one GPU when their host ids
differ): the traffic between hosts is real, the compute is time-shared, and the one-host baseline is
one rank alone on the GPU, without any NVLink. `--cpu` checks the harness on gloo.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from workloads.bench.topology_report import EMULATED, ONE_HOST, build_document, format_document
from workloads.client.cluster import free_port
from workloads.train.config import TrainConfig, preset, with_overrides

TIME_LIMIT_S = 540
"""The command stops its runs here, leaving time to write the document inside a 10-minute device
command; bench.json then holds what finished."""
BANDWIDTH_SIZES = (64 * 2**20, 256 * 2**20, 1 * 2**30)
"""All-reduce sizes measured in each phase: around a decoder layer's gradients (47M parameters:
94 MB in bf16, 187 MB in fp32) and the root's (233M: 467 MB, 934 MB)."""
CPU_BANDWIDTH_SIZES = (2**20, 4 * 2**20)
TOPOLOGY_PREFIX = "[topology] "


@dataclass(frozen=True, kw_only=True)
class Layout:
    gpus: int
    """GPUs of this machine (0: the CPU harness check)."""
    gpus_per_host: int
    shared: bool
    """One GPU: the two hosts' ranks share it."""

    @property
    def ranks_per_gpu(self) -> int:
        return 2 if self.shared else 1

    @property
    def one_host_ranks(self) -> int:
        """Ranks of the one-host baseline: all the emulated hosts' GPUs, or one rank alone on a
        shared GPU (NCCL refuses two ranks of one host on one GPU)."""
        return 1 if self.shared else 2 * self.gpus_per_host

    def devices(self, host: Optional[int]) -> str:
        """CUDA_VISIBLE_DEVICES of emulated host `host`, or of the one-host run (None)."""
        if self.gpus == 0:
            return ""
        if self.shared:
            return "0"
        if host is None:
            return ",".join(str(g) for g in range(2 * self.gpus_per_host))
        return ",".join(str(host * self.gpus_per_host + g) for g in range(self.gpus_per_host))

    def limits(self) -> list[str]:
        if self.gpus == 0:
            return ["CPU harness check (gloo): no figure here says anything about GPUs or NCCL"]
        if self.shared:
            return [
                "one GPU: both emulated hosts' ranks time-share it, so each computes at about half speed",
                "no one-host NVLink baseline (it needs two GPUs): 'one host' is one rank alone on the GPU, "
                "with no communication at all, at the same tokens per optimizer step",
                "the NVLink no-regression check (>= 52,000 tokens/s/GPU) needs two GPUs",
            ]
        return []


def layout_for(gpus: int, *, gpus_per_host: int = 0, cpu: bool = False) -> Layout:
    if cpu:
        return Layout(gpus=0, gpus_per_host=1, shared=False)
    if gpus < 1:
        raise ValueError("no GPU visible: run on a GPU machine, or pass --cpu to check the harness on gloo")
    if gpus == 1:
        if gpus_per_host > 1:
            raise ValueError(f"--gpus-per-host {gpus_per_host}: this machine has one GPU")
        return Layout(gpus=1, gpus_per_host=1, shared=True)
    per_host = gpus_per_host or gpus // 2
    if per_host < 1 or 2 * per_host > gpus:
        raise ValueError(f"--gpus-per-host {per_host}: two hosts need {2 * per_host} GPUs, this machine has {gpus}")
    return Layout(gpus=gpus, gpus_per_host=per_host, shared=False)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    label: str
    overrides: tuple[str, ...]
    """`--set` assignments on top of the benchmark's job config."""
    grad_accum_steps: int
    log_every_step: bool = True
    """Read the loss back every step (the loss curve); the no-regression run reads it once."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    preset: str
    micro_batch: int
    grad_accum_steps: int
    seq_len: int
    steps: int
    warmup: int
    lr: float
    runs: dict[str, tuple[RunSpec, ...]] = field(default_factory=dict)
    bandwidth_sizes: tuple[int, ...] = BANDWIDTH_SIZES
    overrides: tuple[str, ...] = ()
    """Extra `--set` assignments for every run (e.g. a smaller model for the CPU check)."""


def plan_runs(layout: Layout, *, grad_accum_steps: int, skip_k1: bool = False) -> dict[str, tuple[RunSpec, ...]]:
    k = grad_accum_steps
    flat = ("parallelism=fsdp", "cross_node_reduce_dtype=float32")
    # Most telling first: a run stopped at the time limit leaves the headline comparisons.
    emulated = [
        RunSpec(label="auto", overrides=(), grad_accum_steps=k),
        RunSpec(label="flat", overrides=flat, grad_accum_steps=k),
        RunSpec(label="hsdp-fp32", overrides=("parallelism=hsdp", "cross_node_reduce_dtype=float32"),
                grad_accum_steps=k),
    ]
    # The one-host baseline trains on as many tokens per optimizer step: one rank alone on a shared
    # GPU runs both hosts' micro-steps.
    one_k = k * layout.ranks_per_gpu
    one_host = [RunSpec(label="one-host", overrides=(), grad_accum_steps=one_k)]
    if not skip_k1:
        emulated += [RunSpec(label="flat-k1", overrides=flat, grad_accum_steps=1),
                     RunSpec(label="auto-k1", overrides=(), grad_accum_steps=1)]
        one_host.append(RunSpec(label="one-host-k1", overrides=(), grad_accum_steps=layout.ranks_per_gpu,
                                log_every_step=False))
    return {EMULATED: tuple(emulated), ONE_HOST: tuple(one_host)}


# --- inside torchrun ------------------------------------------------------------------------------------


def job_config(spec: Spec, run: RunSpec) -> TrainConfig:
    """The preset with the benchmark's shape and the run's overrides; no checkpoints and no transport
    gate inside the timed steps (the bandwidth between the hosts is measured before them)."""
    base = with_overrides(preset(spec.preset), [*spec.overrides, *run.overrides])
    return dataclasses.replace(
        base,
        seq_len=spec.seq_len,
        micro_batch=spec.micro_batch,
        grad_accum_steps=run.grad_accum_steps,
        rows_per_step=0,  # each run's micro-steps per rank are the benchmark's
        steps=spec.steps,
        lr=spec.lr,
        warmup_steps=1,
        checkpoint_every=0,
        log_every=1 if run.log_every_step else spec.steps,
        transport=dataclasses.replace(base.transport, enabled=False),
    )


def run_phase(spec: Spec, phase: str, out_json: Path) -> int:
    import torch.distributed as dist

    from workloads.bench.nccl import measure_row
    from workloads.bench.runtime import init_runtime
    from workloads.bench.train_bench import environment, run_job, train_tuned
    from workloads.context import TrainContext

    runtime = init_runtime()
    leader = runtime.rank == 0
    node_rank = int(os.environ.get("GROUP_RANK", runtime.rank // max(1, runtime.local_world_size)))

    def say(line: str) -> None:
        if leader:
            print(TOPOLOGY_PREFIX + line, flush=True)

    document: dict = {"phase": phase, "environment": environment(runtime), "bandwidth": [], "runs": []}

    def save() -> None:
        if leader:
            out_json.write_text(json.dumps(document, indent=1))

    say(f"{phase}: {runtime.world_size} ranks, {runtime.local_world_size} per host")
    for size in spec.bandwidth_sizes:
        row = measure_row("all_reduce", size_bytes=size, runtime=runtime, iters=10, warmup=3)
        document["bandwidth"].append(asdict(row))
        say(f"{phase}: all_reduce {row.size_bytes:,} B busbw {row.busbw_gbps:.2f} GB/s")
    save()
    with tempfile.TemporaryDirectory(prefix="topology-") as scratch:
        ctx = TrainContext(
            rank=runtime.rank,
            world_size=runtime.world_size,
            local_rank=runtime.local_rank,
            local_world_size=runtime.local_world_size,
            node_rank=node_rank,
            report=lambda metrics, checkpoint_dir=None: None,
            latest_checkpoint=lambda: None,
            scratch_dir=Path(scratch),
        )
        for run in spec.runs[phase]:
            cfg = job_config(spec, run)
            say(f"{run.label}: micro-batch {cfg.micro_batch} x {cfg.grad_accum_steps} micro-steps, {cfg.steps} steps")
            began = time.perf_counter()
            try:
                record = asdict(run_job(run.label, train_tuned, cfg, runtime=runtime, ctx=ctx,
                                        profile_steps=(cfg.steps, cfg.steps), profile_out=None))
            except Exception as e:  # one failed run must not cost the others their figures
                traceback.print_exc()
                record = {"strategy": run.label, "micro_batch": cfg.micro_batch, "status": "error",
                          "error": f"{type(e).__name__}: {e}"[:1000], "step_seconds": {}, "losses": {},
                          "tokens_per_step_per_gpu": cfg.samples_per_rank_per_step * cfg.seq_len}
            record["grad_accum_steps"] = cfg.grad_accum_steps
            record["config"] = {k: v for k, v in cfg.to_dict().items() if k != "transport"}
            record["wall_s"] = time.perf_counter() - began
            document["runs"].append(record)
            save()
            say(f"{run.label}: {record['status']} in {record['wall_s']:.0f} s")
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --- the driver -----------------------------------------------------------------------------------------


def base_env(layout: Layout) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "4")})
    if layout.gpus == 0:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def host_env(layout: Layout, host: int) -> dict[str, str]:
    env = base_env(layout)
    env.update({"CUDA_VISIBLE_DEVICES": layout.devices(host), "NCCL_HOSTID": f"emulated-host-{host}",
                "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"})
    return env


def torchrun(args: Sequence[str], *, worker: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "-m", "workloads.bench.topology", *worker]


class Launch:
    """A torchrun started in its own process group, its output to a log (and echoed when `echo`)."""

    def __init__(self, argv: list[str], *, env: dict, log: Path, echo: bool) -> None:
        self.log = log
        self._file = log.open("w")
        self._file.write("$ " + " ".join(argv) + "\n")
        self._file.flush()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._thread = threading.Thread(target=self._pump, args=(echo,), daemon=True)
        self._thread.start()

    def _pump(self, echo: bool) -> None:
        for line in self.proc.stdout:
            self._file.write(line)
            if echo and (line.startswith(TOPOLOGY_PREFIX) or "Error" in line or "error:" in line):
                print(line, end="", flush=True)

    def wait(self, deadline: float) -> Optional[int]:
        """The exit code, or None when it ran past the deadline (then it and its children are killed)."""
        try:
            code = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            code = None
        self._thread.join(timeout=10)
        self._file.write(f"exit code: {code if code is not None else 'killed at the time limit'}\n")
        self._file.close()
        return code


def run_emulated(spec_file: Path, layout: Layout, out: Path, parts: Path, deadline: float) -> dict:
    port = free_port()
    launches = []
    for host in (0, 1):
        argv = torchrun(
            ["--nnodes", "2", "--node-rank", str(host), "--nproc-per-node", str(layout.gpus_per_host),
             "--master-addr", "127.0.0.1", "--master-port", str(port)],
            worker=["worker", "--spec", str(spec_file), "--phase", EMULATED,
                    "--out-json", str(parts / f"{EMULATED}.json")],
        )
        launches.append(Launch(argv, env=host_env(layout, host), log=out / f"emulated-host{host}.log", echo=host == 0))
    return {f"host{i}": launch.wait(deadline) for i, launch in enumerate(launches)}


def run_one_host(spec_file: Path, layout: Layout, out: Path, parts: Path, deadline: float) -> dict:
    env = base_env(layout)
    env["CUDA_VISIBLE_DEVICES"] = layout.devices(None)
    for name in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    argv = torchrun(["--standalone", "--nproc-per-node", str(layout.one_host_ranks)],
                    worker=["worker", "--spec", str(spec_file), "--phase", ONE_HOST,
                            "--out-json", str(parts / f"{ONE_HOST}.json")])
    return {"host": Launch(argv, env=env, log=out / "one-host.log", echo=True).wait(deadline)}


def transport_lines(log: Path) -> dict[str, int]:
    """How NCCL connected ranks, counted from its INFO lines ("via NET/Socket/0", "via P2P/...")."""
    counts: dict[str, int] = {}
    if log.is_file():
        for match in re.finditer(r" via (NET/\w+|P2P|SHM)", log.read_text(errors="replace")):
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.topology", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench.json, table.txt and the logs")
    parser.add_argument("--preset", default="qwen2.5-1.5b-synthetic")
    parser.add_argument("--micro-batch", type=int, default=0, help="default 16 (4 when two ranks share one GPU)")
    parser.add_argument("--grad-accum-steps", type=int, default=8, help="micro-steps per optimizer step (default 8)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run; the last is profiled")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (compilation)")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="peak learning rate, high enough that the loss curves move in a few steps")
    parser.add_argument("--gpus-per-host", type=int, default=0, help="default: half the GPUs")
    parser.add_argument("--skip-k1", action="store_true", help="leave out the runs without accumulation")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    parser.add_argument("--cpu", action="store_true", help="check the harness on gloo with the tiny model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every run")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        gpus = 0 if args.cpu else _gpu_count()
        layout = layout_for(gpus, gpus_per_host=args.gpus_per_host, cpu=args.cpu)
        if args.warmup < 1 or args.steps < args.warmup + 2:
            raise ValueError(f"--steps {args.steps} --warmup {args.warmup}: need warmup >= 1 and steps >= warmup + 2 "
                             "(timed steps, then the profiled last one)")
        if args.grad_accum_steps < 1:
            raise ValueError(f"--grad-accum-steps {args.grad_accum_steps}: use 1 or more")
        spec = Spec(
            preset=args.preset,
            micro_batch=args.micro_batch or (4 if layout.shared else 16),
            grad_accum_steps=args.grad_accum_steps,
            seq_len=args.seq_len,
            steps=args.steps,
            warmup=args.warmup,
            lr=args.lr,
            runs=plan_runs(layout, grad_accum_steps=args.grad_accum_steps, skip_k1=args.skip_k1),
            overrides=tuple(args.overrides),
            bandwidth_sizes=CPU_BANDWIDTH_SIZES if args.cpu else BANDWIDTH_SIZES,
        )
        for runs in spec.runs.values():
            for run in runs:
                job_config(spec, run)  # bad overrides fail here, before anything starts
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = started + args.time_limit
    print(f"{TOPOLOGY_PREFIX}{layout.gpus} GPU(s): 2 emulated hosts x {layout.gpus_per_host} GPU(s)"
          f"{' (sharing GPU 0)' if layout.shared else ''}; one host: {layout.one_host_ranks} rank(s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="topology-") as tmp:
        parts = Path(tmp)
        spec_file = parts / "spec.json"
        spec_file.write_text(json.dumps(spec_to_dict(spec)))
        # The baseline first: it is short, and it calibrates the step-time model.
        exits = {ONE_HOST: run_one_host(spec_file, layout, out, parts, deadline)}
        if time.monotonic() < deadline - 60:
            exits[EMULATED] = run_emulated(spec_file, layout, out, parts, deadline)
        phases = {p: json.loads((parts / f"{p}.json").read_text()) for p in (EMULATED, ONE_HOST)
                  if (parts / f"{p}.json").is_file()}
    transport = {f"emulated-host{h}": transport_lines(out / f"emulated-host{h}.log") for h in (0, 1)}
    document = build_document(spec=spec_to_dict(spec), layout=asdict(layout), limits=layout.limits(), phases=phases,
                              exits=exits, transport=transport, wall_s=time.monotonic() - started)
    (out / "bench.json").write_text(json.dumps(document, indent=2) + "\n")
    table = format_document(document)
    (out / "table.txt").write_text(table + "\n")
    print(table, flush=True)
    failed = any(code != 0 for phase in exits.values() for code in phase.values())
    return 1 if failed else 0


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def spec_to_dict(spec: Spec) -> dict:
    return asdict(spec)


def spec_from_dict(d: dict) -> Spec:
    runs = {phase: tuple(RunSpec(**{**r, "overrides": tuple(r["overrides"])}) for r in rs)
            for phase, rs in d["runs"].items()}
    return Spec(**{**d, "runs": runs, "bandwidth_sizes": tuple(d["bandwidth_sizes"]),
                   "overrides": tuple(d["overrides"])})


def worker_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.topology worker")
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--phase", choices=(EMULATED, ONE_HOST), required=True)
    parser.add_argument("--out-json", type=Path, required=True)
    args = parser.parse_args(argv)
    return run_phase(spec_from_dict(json.loads(args.spec.read_text())), args.phase, args.out_json)


if __name__ == "__main__":
    sys.exit(main())
