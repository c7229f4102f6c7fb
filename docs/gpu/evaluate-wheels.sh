#!/usr/bin/env bash
# Wheels for `docs/gpu/record.sh evaluate` on a GPU host without network (Python 3.12 with torch,
# transformers, accelerate, peft, pyarrow, pandas, sacrebleu, scikit-learn, tqdm, regex and
# huggingface-hub already installed): EleutherAI's lm-evaluation-harness at the project's pins
# (pyproject's `evaluate` extra) and what it needs that such a host lacks. Three of them are published
# as source only (rouge-score, sqlitedict, word2number): pure Python, built into wheels here.
# Run where pip reaches PyPI:  docs/gpu/evaluate-wheels.sh DIR   (about 14 MB)
# On the host: python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#              PYTHONPATH=/tmp/site docs/gpu/record.sh evaluate OUT
set -euo pipefail
out=${1:?usage: docs/gpu/evaluate-wheels.sh DIR}
mkdir -p "$out"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$out" lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
  pytablewriter==1.2.1 dataproperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 \
  tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 more-itertools==11.2.1 nltk==3.10.4 absl-py==2.5.1 \
  six==1.17.0 defusedxml==0.7.1 click==8.5.1
python3 -m pip wheel --no-deps -w "$out" rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1
python3 - "$out" <<'PY'
import pathlib, sys
wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
print(f"{len(wheels)} wheels, {sum(p.stat().st_size for p in wheels) / 2**20:.1f} MiB")
PY
