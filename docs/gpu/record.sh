#!/usr/bin/env bash
# Reproduces the GPU runs recorded in docs/ on a 2-GPU host (torchrun; Ray is not needed):
#   docs/gpu/record.sh gate OUT    the in-band transport gate over NVLink, then with P2P/SHM disabled
#   docs/gpu/record.sh nccl OUT    NCCL bus bandwidth by message size
#   docs/gpu/record.sh bench OUT   reference vs tuned training throughput
#   docs/gpu/record.sh topology OUT    flat FSDP vs HSDP vs HSDP with accumulation on two emulated hosts
#                                      (NCCL_HOSTID each, sockets on loopback) and the one-host baseline
#   docs/gpu/record.sh rehearsal OUT   the job path with Ray in the EKS cluster's shape: a GPU-less head,
#                                      two worker nodes (NCCL_HOSTID each), moto S3, the user's submit
#                                      command three times (needs Ray and moto: docs/gpu/wheels.sh)
# Each writes its logs under OUT. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail
what=$1 out=$2
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
run() { echo "\$ $*" | tee -a "$out/commands.txt"; "$@"; }

case $what in
gate)
  # Passes: ranks on one node must connect through P2P/NVLink, and bandwidth clears the floor.
  run torchrun --nproc-per-node "$gpus" -m workloads.launch.torchrun --preset qwen2.5-1.5b --steps 4 --set checkpoint_every=0 \
      --out "$out/gate-nvlink" 2>&1 | tee "$out/gate-nvlink.txt"
  echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/gate-nvlink.txt"
  # Must stop before the first training step: NCCL is pushed onto TCP sockets.
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 run torchrun --nproc-per-node "$gpus" -m workloads.launch.torchrun \
      --preset qwen2.5-1.5b --steps 4 --set checkpoint_every=0 --out "$out/gate-socket" 2>&1 | tee "$out/gate-socket.txt"
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
topology)
  shift 2
  run python3 -m workloads.bench.topology --out "$out/topology" "$@" 2>&1 | tee "$out/topology.txt"
  ;;
rehearsal)
  run python3 -m workloads.bench.rehearsal --out "$out/rehearsal" 2>&1 | tee "$out/rehearsal.txt"
  ;;
*) echo "usage: $0 gate|nccl|bench|topology|rehearsal OUT" >&2; exit 2 ;;
esac
