#!/usr/bin/env bash
# Wheels for `docs/gpu/record.sh perf3` and `stability` on a GPU host without network (Python 3.12, torch 2.11,
# transformers, peft, accelerate, numpy already installed): liger-kernel (the loop's fused loss on CUDA and the
# Trainer peer's use_liger_kernel) and matplotlib with its small dependencies (the stability plot).
# Run where pip reaches PyPI:  docs/gpu/wheels-perf.sh DIR   (about 24 MiB)
# On the host: python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl; export PYTHONPATH=/tmp/site
set -euo pipefail
out=${1:?usage: docs/gpu/wheels-perf.sh DIR}
mkdir -p "$out"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$out" liger-kernel==0.8.5 matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 \
  kiwisolver==1.5.1 pillow==13.0.0 pyparsing==3.3.3 python-dateutil==2.9.0.post0 six==1.17.0
python3 - "$out" <<'PY'
import pathlib, sys
out = pathlib.Path(sys.argv[1])
total = sum(p.stat().st_size for p in out.glob("*.whl"))
print(f"{len(list(out.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")
PY
