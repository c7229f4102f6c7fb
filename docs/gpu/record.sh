#!/usr/bin/env bash
# Reproduces the GPU runs recorded in docs/ on a 2-GPU host (torchrun; Ray is not needed):
#   docs/gpu/record.sh gate OUT    the in-band transport gate over NVLink, then with P2P/SHM disabled
#   docs/gpu/record.sh nccl OUT    NCCL bus bandwidth by message size
#   docs/gpu/record.sh bench OUT   reference vs tuned training throughput
#   docs/gpu/record.sh topology OUT    flat FSDP vs HSDP vs HSDP with accumulation on two emulated hosts
#                                      (NCCL_HOSTID each, sockets on loopback) and the one-host baseline
#   docs/gpu/record.sh rehearsal OUT   the job path with Ray in the EKS cluster's shape: a GPU-less head,
#                                      two worker nodes (NCCL_HOSTID each), moto S3, the user's submit
#                                      command four times (needs Ray and moto: docs/gpu/wheels.sh);
#                                      `--cases d-node` runs one of them; `--cases e-spot` the Spot
#                                      interruption with --min-nodes 1 (docs/RELIABILITY.md 2b)
#   docs/gpu/record.sh chats OUT   the loop on synthetic tokens and on generated chats (packed, labels on the
#                                  answers) at micro-batch 16, then on the chats with sdpa and flex_attention
#                                  instead of varlen; and the attention and loss kernels alone (bench.kernels)
#   docs/gpu/record.sh cap24 OUT   the 24 GB preset on generated chats, each process capped at 22 GiB: four
#                                  ranks on one GPU, each its own emulated host (NCCL_HOSTID), flat FSDP over
#                                  the four as over a g6.12xlarge's four L4s (its peak memory; not its speed),
#                                  the model's shape with random weights (no hub here)
#   docs/gpu/record.sh load OUT    a full-size Qwen2.5-1.5B folder made here (random weights), loaded into
#                                  FSDP2 shards, trained (tokens/s at micro-batch 16), exported, reloaded
#   docs/gpu/record.sh memory OUT  the memory model's prediction against each point's peak on one GPU, each run
#                                  capped at its prediction plus 10% (workloads/bench/memory_check.py)
#   docs/gpu/record.sh peers OUT   the loop against Hugging Face's Trainer (peft for LoRA) on the same chats:
#                                  Qwen2.5-1.5B full at micro-batch 16 (30 steps), then Qwen2.5-7B LoRA r16 at
#                                  micro-batch 8 (12 steps; needs peft and liger-kernel)
# Each writes its logs under OUT. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail
what=$1 out=$2
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
run() { echo "\$ $*" | tee -a "$out/commands.txt"; "$@"; }

case $what in
gate)
  # Each verdict must read only its own run's logs: no NCCL log left from an earlier run in OUT.
  rm -rf "$out/gate-nvlink" "$out/gate-socket"
  # Passes: ranks on one node must connect through P2P/NVLink, and bandwidth clears the floor.
  run torchrun --nproc-per-node "$gpus" -m workloads.launch.torchrun --preset qwen2.5-1.5b-synthetic --steps 4 --set checkpoint_every=0 \
      --out "$out/gate-nvlink" 2>&1 | tee "$out/gate-nvlink.txt"
  echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/gate-nvlink.txt"
  # Must stop before the first training step: NCCL is pushed onto TCP sockets.
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 run torchrun --nproc-per-node "$gpus" -m workloads.launch.torchrun \
      --preset qwen2.5-1.5b-synthetic --steps 4 --set checkpoint_every=0 --out "$out/gate-socket" 2>&1 | tee "$out/gate-socket.txt"
  echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/gate-socket.txt"
  for d in gate-nvlink gate-socket; do
    run python3 -m workloads verify-transport "$out/$d"/nccl/*.log --nodes 1 2>&1 | tee -a "$out/$d.txt"
  done
  ;;
nccl)
  run torchrun --nproc-per-node "$gpus" -m workloads.bench nccl --out "$out/nccl" 2>&1 | tee "$out/nccl.txt"
  ;;
bench)
  shift 2
  run torchrun --nproc-per-node "$gpus" -m workloads.bench --out "$out/bench" "$@" 2>&1 | tee "$out/bench.txt"
  ;;
load)
  # ARCH=tiny-qwen2 PRESET=demo-cpu run the same steps on CPU (two gloo ranks) as a dry run.
  arch=${ARCH:-qwen2.5-1.5b} preset=${PRESET:-qwen2.5-1.5b-synthetic} ranks=$gpus
  [ "$ranks" -gt 0 ] || ranks=2
  model="$out/$arch-random" prompt="What is the capital of France?"
  # No hub here: the full-size model is made with save_pretrained (bf16, as the hub's), with the toy
  # tokenizer and toy chats (workloads/model_io/toy.py).
  run python3 -m workloads.model_io.toy --architecture "$arch" --dtype bfloat16 --out "$model" \
      --chat-jsonl "$out/chat.jsonl" --conversations 20000 2>&1 | tee "$out/load-make.txt"
  # For comparison: the whole model as from_pretrained gives it, in fp32, on one GPU.
  run python3 - "$model" <<'PY' 2>&1 | tee "$out/load-whole.txt"
import json, resource, sys, time, torch
from transformers import AutoModelForCausalLM
cuda = torch.cuda.is_available()
started = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).to("cuda" if cuda else "cpu")
if cuda:
    torch.cuda.synchronize()
print("[whole-model-load] " + json.dumps({"seconds": round(time.perf_counter() - started, 2),
      "peak_host_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
      "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}))
PY
  # The loop's load (meta device, FSDP2, each rank fills its shards from the safetensors files; the
  # [model-load] line has every rank's seconds, bytes read, peak host and GPU memory), then the
  # benchmark's steps: synthetic tokens, micro-batch 16 (tokens/s in summary.json), and the final
  # checkpoint's export (model/ in checkpoint-0000040).
  run torchrun --nproc-per-node "$ranks" -m workloads.launch.torchrun --preset "$preset" --steps 40 \
      --set model.name_or_path="$model" --set checkpoint_every=40 --set log_every=10 --set eval_every=0 \
      --out "$out/load-train" 2>&1 | tee "$out/load-train.txt"
  echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/load-train.txt"
  # The same model on packed chats (attention kept inside each sample), with the held-out loss.
  run torchrun --nproc-per-node "$ranks" -m workloads.launch.torchrun --preset "$preset" --steps 30 \
      --set model.name_or_path="$model" --set data.kind=jsonl --set data.path="$out/chat.jsonl" \
      --set eval_every=10 --set checkpoint_every=0 --out "$out/load-chat" 2>&1 | tee "$out/load-chat.txt"
  echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/load-chat.txt"
  # Out: the run's own export, and the same checkpoint consolidated again from its shards; each is
  # loaded with from_pretrained and generates. The two must hold the same tensors.
  run python3 -m workloads export "$out/load-train" --out "$out/export-run" --generate "$prompt" 2>&1 | tee "$out/load-export.txt"
  run python3 -m workloads export "$out/load-train" --from-shards --out "$out/export-shards" --generate "$prompt" \
      2>&1 | tee -a "$out/load-export.txt"
  run python3 - "$out/export-run" "$out/export-shards" <<'PY' 2>&1 | tee -a "$out/load-export.txt"
import sys, torch
from pathlib import Path
from safetensors.torch import load_file
a, b = ({k: v for f in sorted(Path(d).glob("*.safetensors")) for k, v in load_file(f).items()} for d in sys.argv[1:])
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print(f"exports identical: {same} ({len(a)} tensors, {sum(t.numel() for t in a.values()):,} parameters, "
      f"{next(iter(a.values())).dtype})")
sys.exit(0 if same else 1)
PY
  du -sh "$out"/export-* "$model" | tee -a "$out/load-export.txt"
  # Checkpoints and model copies are large; keep what the record needs.
  rm -rf "$out"/load-train/checkpoint-* "$out"/export-* "$model"/*.safetensors
  ;;
chats)
  shift 2
  run torchrun --nproc-per-node "$gpus" -m workloads.bench --strategies tuned --data synthetic,chats \
      --micro-batches 16 --out "$out/bench" "$@" 2>&1 | tee "$out/bench.txt"
  for attn in sdpa flex_attention; do
    run torchrun --nproc-per-node "$gpus" -m workloads.bench --strategies tuned --data chats --micro-batches 16 \
        --steps 20 --set model.attn_implementation=$attn --out "$out/bench-$attn" 2>&1 | tee "$out/bench-$attn.txt"
  done
  run python3 -m workloads.bench.kernels --out "$out/kernels" 2>&1 | tee "$out/kernels.txt"
  ;;
cap24)
  shift 2
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  for r in 0 1 2 3; do
    NCCL_HOSTID=cap24-host-$r NCCL_SOCKET_IFNAME=lo torchrun --nnodes 4 --node-rank $r --nproc-per-node 1 \
        --master-addr 127.0.0.1 --master-port "$port" -m workloads.bench --preset qwen2.5-1.5b-24gb --data chats \
        --strategies tuned --micro-batches 2 --steps 4 --warmup 1 --matmul-size 0 --set parallelism=fsdp \
        --set model.name_or_path=qwen2.5-1.5b \
        --memory-cap-gib 22 --out "$out/cap24" "$@" > "$out/cap24-rank$r.txt" 2>&1 &
  done
  wait
  cat "$out/cap24-rank0.txt"
  ;;
topology)
  shift 2
  run python3 -m workloads.bench.topology --out "$out/topology" "$@" 2>&1 | tee "$out/topology.txt"
  ;;
rehearsal)
  shift 2
  run python3 -m workloads.rehearse.rehearsal --out "$out/rehearsal" "$@" 2>&1 | tee "$out/rehearsal.txt"
  ;;
memory)
  shift 2
  run python3 -m workloads.bench.memory_check --out "$out/memory" "$@" 2>&1 | tee "$out/memory.txt"
  ;;
peers)
  shift 2
  # The padded Trainer runs out of memory at micro-batch 16 here (2026-12-04); one micro-step per step.
  run torchrun --nproc-per-node 1 -m workloads.bench --preset qwen2.5-1.5b-synthetic --data chats --micro-batches 16 \
      --strategies tuned,hf-trainer --steps 30 --warmup 5 --out "$out/peers-1.5b" "$@" 2>&1 | tee "$out/peers-1.5b.txt"
  # The padded Trainer before the padding-free one: on 2026-12-04 the padding-free Trainer + peft gave no 7B
  # step in 7.5 minutes, and bench.json keeps each run as it ends (the [bench] step lines show where a run is).
  run torchrun --nproc-per-node 1 -m workloads.bench --preset qwen2.5-7b-lora-24gb --data chats --micro-batches 8 \
      --strategies tuned,hf-trainer-padded,hf-trainer --steps 12 --warmup 4 --matmul-size 0 \
      --set model.name_or_path=qwen2.5-7b --set model.activation_checkpointing=false --set rows_per_step=0 \
      --set grad_accum_steps=1 --set peak_flops=989e12 --out "$out/peers-7b-lora" "$@" 2>&1 | tee "$out/peers-7b-lora.txt"
  ;;
*) echo "usage: $0 gate|nccl|bench|chats|cap24|topology|rehearsal|load|memory|peers OUT" >&2; exit 2 ;;
esac
