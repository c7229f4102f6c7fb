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
#   docs/gpu/record.sh perf3 OUT   one GPU, at most 8 minutes: the 7B LoRA r16 at micro-batch 4 checkpointed (with the
#                                  Trainer + peft peer), checkpointed and offloaded, and without checkpointing (with the
#                                  peer; profiled), then the 1.5B full fine-tune at micro-batch 16 (profiled); the
#                                  checkpointed runs' last step replayed to its memory peak (OUT/perf/*/memory-*.txt); every
#                                  figure with the memory model's prediction in OUT/perf/perf.json (needs the wheels of
#                                  docs/gpu/wheels.sh DIR perf: liger-kernel). CPU_DRY_RUN=1: the same calls on
#                                  the tiny model on the CPU
#   docs/gpu/record.sh stability OUT   one GPU, about 8 minutes: the 1.5B chats fine-tune (the qwen2.5-1.5b preset on
#                                  the model's shape and generated chats), then its tokens/s drift and memory step over
#                                  step checked and plotted (workloads/bench/stability.py); CPU_DRY_RUN=1 as above
#   docs/gpu/record.sh dpo OUT     the loop's DPO against TRL's DPOTrainer (trl 1.16.0, peft for LoRA, liger's layer
#                                  kernels, padded: TRL 1.16 has no padding-free DPO) on the same generated pairs,
#                                  about the same pairs per optimizer step, one GPU: Qwen2.5-1.5B full (the
#                                  reference a frozen bf16 copy on both sides), then Qwen2.5-7B LoRA r16 with
#                                  activation checkpointing (the reference: adapters off); random weights of the
#                                  real shapes. Writes OUT/dpo.json (tokens/s, ratio, peaks, the memory model's
#                                  peak). Needs TRL, datasets and liger-kernel: docs/gpu/wheels.sh DIR dpo. A CPU dry
#                                  run of the same steps: DRY_RUN=1 (tiny-qwen2, rows of 512, a few steps)
#   docs/gpu/record.sh evaluate OUT  the evaluation stage (python -m workloads evaluate: tuned and base on RECORDS=256
#                                  held-out chats, the base's cache) against lm-eval's own CLI on the same task folder,
#                                  models and GPU, each timed end to end (workloads/bench/evaluate_peer.py; needs the
#                                  wheels of docs/gpu/wheels.sh DIR evaluate). ARCH=tiny-qwen2 runs it on CPU as a dry run
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
perf3)
  shift 2
  # Each call is cut at its limit (timeout): bench.json keeps the runs that ended, so a stuck peer costs its
  # call's share of the 8 minutes and no more. The Trainer's lines ([hf-trainer] forward/step) say where it is.
  # The 1.5B full fine-tune at micro-batch 16 needs more than an H100's 80 GB (OOM there on 2026-12-05): 8 there.
  full_mb=$(python3 -c 'import torch; print(16 if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100e9 else 8)')
  ranks=1 lora_mb=4 steps=11 model=qwen2.5-7b lora_preset=qwen2.5-7b-lora-24gb full_preset=qwen2.5-1.5b-synthetic
  # The checkpointed Trainer + peft peer compiles for about a minute before its first step (54 s on 2026-12-05,
  # when 160 s in all cut it off): its call has 230 s.
  limits=(230 80 160 70) extra=(--set peak_flops=989e12)
  if [ -n "${CPU_DRY_RUN:-}" ]; then  # the same calls on the tiny model: the harness, not the figures
    lora_mb=2 full_mb=4 steps=6 model=tiny-qwen2 lora_preset=demo-cpu full_preset=demo-cpu limits=(600 600 600 600)
    extra=(--allow-cpu --seq-len 64 --set method=lora --set lora.rank=4)
  fi
  lora=(--preset "$lora_preset" --data chats --micro-batches "$lora_mb" --steps "$steps" --warmup 4 --matmul-size 0
        --set model.name_or_path="$model" --set rows_per_step=0 --set grad_accum_steps=1 "${extra[@]}")
  call() {  # NAME LIMIT_S ARGS...: one benchmark call into OUT/perf/NAME
    local name=$1 limit=$2; shift 2
    echo "\$ timeout $limit torchrun --nproc-per-node $ranks -m workloads.bench --out $out/perf/$name $*" \
      | tee -a "$out/commands.txt"
    PYTHONUNBUFFERED=1 timeout "$limit" torchrun --nproc-per-node "$ranks" -m workloads.bench --out "$out/perf/$name" \
      "$@" 2>&1 | tee "$out/perf-$name.txt"
    echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/perf-$name.txt"
  }
  # The checkpointed runs' last step is recorded by the allocator and replayed to its peak: memory-*.txt says
  # what was alive there and where it came from (workloads/bench/memory_window.py).
  call 7b-lora-ac "${limits[0]}" "${lora[@]}" --strategies tuned,hf-trainer --set model.activation_checkpointing=true \
      --memory-steps "$steps:$steps"
  call 7b-lora-offload "${limits[1]}" "${lora[@]}" --strategies tuned --set model.activation_checkpointing=true \
      --set model.activation_offloading=true --memory-steps "$steps:$steps"
  call 7b-lora "${limits[2]}" "${lora[@]}" --strategies tuned,hf-trainer --set model.activation_checkpointing=false \
      --profile-steps "$steps:$steps"
  if [ -n "${CPU_DRY_RUN:-}" ]; then extra=(--allow-cpu --seq-len 64); fi
  call 1.5b-full "${limits[3]}" --preset "$full_preset" --data chats --micro-batches "$full_mb" --steps "$steps" \
      --warmup 4 --matmul-size 0 --strategies tuned --set rows_per_step=0 --set grad_accum_steps=1 \
      --profile-steps "$steps:$steps" "${extra[@]}"
  run python3 -m workloads.bench.perf_record "$out/perf" 2>&1 | tee "$out/perf.txt"
  ;;
stability)
  shift 2
  # Micro-batch 16 runs out of memory on an H100's 80 GB (2026-12-05, as in perf3): 8 there, at about 0.43 s a step.
  mb=$(python3 -c 'import torch; print(16 if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100e9 else 8)')
  # About 8 minutes of training either way: 780 steps of 16 rows at 0.62 s (H200), 1,120 of 8 at 0.43 s (H100);
  # the 6,000 chats are about 2,800 rows, read again each epoch in a new order.
  preset=qwen2.5-1.5b model=qwen2.5-1.5b steps=${STEPS:-$(( mb == 16 ? 780 : 1120 ))} chats=6000 ranks=1
  if [ -n "${CPU_DRY_RUN:-}" ]; then
    preset=demo-cpu model=tiny-qwen2 steps=${STEPS:-120} mb=4 chats=400 ranks=1
    set -- --set seq_len=64 "$@"
  fi
  run python3 -c 'import sys; from pathlib import Path; from workloads.bench.chats import write_chat_data
print(write_chat_data(Path(sys.argv[1]), count=int(sys.argv[2]), seed=0))' "$out/chats" "$chats"
  run torchrun --nproc-per-node "$ranks" -m workloads.launch.torchrun --preset "$preset" --steps "$steps" \
      --set model.name_or_path="$model" --set data.kind=jsonl --set data.path="$out/chats/chats.jsonl" \
      --set data.tokenizer="$out/chats/tokenizer" --set data.max_examples=0 --set data.eval_fraction=0 \
      --set eval_every=0 --set checkpoint_every=0 --set log_every=5 --set rows_per_step=0 --set grad_accum_steps=1 \
      --set micro_batch="$mb" --set transport.enabled=false --out "$out/stability" "$@" 2>&1 | tee "$out/stability.txt"
  echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/stability.txt"
  run python3 -m workloads.bench.stability "$out/stability" 2>&1 | tee -a "$out/stability.txt"
  ;;
dpo)
  shift 2
  # Rows of 4,096 hold a pair's two sequences (each up to 2,048 positions), about 2.1 pairs: one row per
  # micro-step and 8 micro-steps (about 17 pairs a step); TRL 2 pairs per micro-step and as many
  # micro-steps as make the same pairs. Each case is bounded (200 s, 250 s: the 7B weights are made on the host) so that both fit
  # one 8-minute call; bench.json keeps every run that ended.
  full=(--preset qwen2.5-1.5b-dpo --set model.name_or_path=qwen2.5-1.5b) lora=(--preset qwen2.5-7b-lora-dpo-24gb
        --set model.name_or_path=qwen2.5-7b) shape=(--seq-len 4096 --micro-batches 1) cpu=()
  steps_full=(--steps 8 --warmup 3) steps_lora=(--steps 6 --warmup 2) limit_full=${LIMIT_FULL:-200} limit_lora=${LIMIT_LORA:-250}
  if [ -n "${DRY_RUN:-}" ]; then
    full=(--preset demo-cpu-dpo) lora=(--preset demo-cpu-dpo --set method=lora --set lora.rank=16)
    shape=(--seq-len 512 --micro-batches 1) cpu=(--allow-cpu) steps_full=(--steps 4 --warmup 1)
    steps_lora=(--steps 4 --warmup 1)
  fi
  python3 -c 'import pyarrow, trl, datasets; print("trl", trl.__version__, "datasets", datasets.__version__,
  "pyarrow", pyarrow.__version__)' 2>&1 | tee "$out/dpo-env.txt"
  common=(--data pairs --strategies tuned,trl-dpo --matmul-size 0 --set rows_per_step=0 --set grad_accum_steps=8
          --peer-micro-batch 2 "${shape[@]}" "${cpu[@]}")
  run timeout "$limit_full" torchrun --nproc-per-node 1 -m workloads.bench "${full[@]}" "${common[@]}" "${steps_full[@]}" \
      --out "$out/dpo-1.5b" "$@" 2>&1 | tee "$out/dpo-1.5b.txt"
  run timeout "$limit_lora" torchrun --nproc-per-node 1 -m workloads.bench "${lora[@]}" "${common[@]}" "${steps_lora[@]}" \
      --set model.activation_checkpointing=true --out "$out/dpo-7b-lora" "$@" 2>&1 | tee "$out/dpo-7b-lora.txt"
  run python3 -m workloads.bench.dpo_record "$out/dpo-1.5b" "$out/dpo-7b-lora" --out "$out/dpo.json" 2>&1 \
      | tee "$out/dpo-record.txt"
  ;;
evaluate)
  # No hub here: two Qwen2.5-1.5B-shaped folders with random weights (bf16) and the toy tokenizer, the
  # "tuned" one another seed of the base, and toy chats (workloads/model_io/toy.py). Random weights never
  # end a turn, so every answer runs its 64 tokens: the generation's worst case, and the same work on
  # both sides. OUT/figures.json: each command's seconds, the scores and the generation speed.
  arch=${ARCH:-qwen2.5-1.5b} records=${RECORDS:-256} device=cuda
  [ "$gpus" -gt 0 ] || device=cpu
  # The models (3 GB each at 1.5B) live outside OUT, so that OUT holds only the record even when this
  # case is cut short.
  models=$(mktemp -d)
  trap 'rm -rf "$models"' EXIT
  for seed in 0 1; do
    run python3 -m workloads.model_io.toy --architecture "$arch" --dtype bfloat16 --seed $seed --out "$models/model-$seed" \
        --chat-jsonl "$out/chat.jsonl" --conversations $((records * 10)) 2>&1 | tee -a "$out/evaluate-make.txt"
  done
  run python3 -m workloads.bench.evaluate_peer --model "$models/model-1" --base "$models/model-0" --chats "$out/chat.jsonl" \
      --records "$records" --device "$device" --out "$out/evaluate" 2>&1 | tee "$out/evaluate.txt"
  echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/evaluate.txt"
  cp "$out/evaluate/figures.json" "$out/figures.json" 2>/dev/null
  rm -rf "$out"/evaluate/peer-*/*/*samples* "$out/evaluate/evaluation-cache"
  ;;
*) echo "usage: $0 gate|nccl|bench|chats|cap24|topology|rehearsal|load|memory|peers|perf3|stability|dpo|evaluate OUT" >&2; exit 2 ;;
esac
