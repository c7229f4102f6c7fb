#!/usr/bin/env bash
# Wheels the DPO record (docs/gpu/record.sh dpo) needs on a GPU host without network that has Python 3.12,
# torch, transformers, accelerate, peft, pyarrow (21 or newer, TRL's floor), pandas, numpy, tqdm, pyyaml,
# jinja2, psutil and huggingface-hub: TRL's DPOTrainer (the peer), the datasets library it reads pairs
# from, and liger-kernel (the loop's fused SFT loss; TRL's layer kernels). About 3 MB.
# Run where pip reaches PyPI:  docs/gpu/dpo_wheels.sh DIR
# On the host:  python3 -m pip install --no-index --no-deps --target /tmp/dpo-site DIR/*.whl
#               PYTHONPATH=/tmp/dpo-site docs/gpu/record.sh dpo OUT
set -euo pipefail
out=${1:?usage: docs/gpu/dpo_wheels.sh DIR}
mkdir -p "$out"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# The same pins as pyproject.toml (trl, datasets: the dev extra; liger-kernel: the gpu extra), and
# datasets' own small requirements at the versions its pins allow.
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$out" trl==1.16.0 datasets==5.2.0 liger-kernel==0.8.5 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
  fsspec==2026.9.0
total=$(du -cb "$out"/*.whl | tail -1 | cut -f1)
echo "$(ls "$out"/*.whl | wc -l) wheels, $((total / 1024)) KiB"
