#!/usr/bin/env bash
# Wheels for a GPU host without network (Python 3.12 with torch, transformers, accelerate, peft, pyarrow,
# pandas, numpy, matplotlib, sacrebleu, scikit-learn, tqdm, regex and huggingface-hub already installed),
# by what the record needs. Run where pip reaches PyPI:  docs/gpu/wheels.sh DIR [SET]
#   rehearsal (the default)  Ray 2.58 with what its Jobs API and Ray Train need, and moto's S3 server for the
#                            rehearsal's checkpoint storage (about 63 MB once pruned: Ray's Java jars, source
#                            maps, RLlib, Serve and LLM packages, and every botocore service model but S3's and
#                            STS's, RECORD files rewritten so pip installs them)
#   perf                     liger-kernel (the loop's fused loss on CUDA, the Trainer peer's use_liger_kernel):
#                            record.sh perf3 and stability
#   dpo                      TRL's DPOTrainer, the datasets library it reads pairs from, liger-kernel: record.sh dpo
#   evaluate                 EleutherAI's lm-evaluation-harness at the project's pins and what it needs (three of
#                            them, rouge-score, sqlitedict and word2number, are published as source only: pure
#                            Python, built into wheels here): record.sh evaluate
# Sets go together in one DIR (their pins agree). On the host:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
out=${1:?usage: docs/gpu/wheels.sh DIR [rehearsal|perf|dpo|evaluate]}
set=${2:-rehearsal}
mkdir -p "$out"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
download() {
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$out" "$@"
}
count() {
  python3 -c 'import pathlib, sys; w = list(pathlib.Path(sys.argv[1]).glob("*.whl"));
print(f"{len(w)} wheels, {sum(p.stat().st_size for p in w) / 2**20:.1f} MiB")' "$out"
}
case $set in
perf) download liger-kernel==0.8.5; count; exit ;;
dpo)
  download trl==1.16.0 datasets==5.2.0 liger-kernel==0.8.5 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
    fsspec==2026.9.0
  count; exit ;;
evaluate)
  download lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
    pytablewriter==1.2.1 dataproperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 \
    tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 more-itertools==11.2.1 nltk==3.10.4 absl-py==2.5.1 \
    six==1.17.0 defusedxml==0.7.1 click==8.5.1 pytz==2026.6
  python3 -m pip wheel --no-deps -w "$out" rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1
  count; exit ;;
rehearsal) ;;
*) echo "usage: $0 DIR [rehearsal|perf|dpo|evaluate]" >&2; exit 2 ;;
esac
download ray==2.58.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 aiohttp-cors==0.8.1 colorful==0.5.8 opencensus==0.11.4 opencensus-context==0.1.3 \
  google-api-core==2.44.0 google-auth==2.63.0 googleapis-common-protos==1.76.0 proto-plus==1.29.0 \
  pyasn1==0.6.5 pyasn1-modules==0.4.2 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2 \
  opentelemetry-proto==1.45.2 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 \
  annotated-types==0.8.0 smart-open==9.0.2 tensorboardx==2.6.5 \
  moto==5.2.5 boto3==1.44.5 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0 xmltodict==1.0.4 \
  responses==0.26.3 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 py-partiql-parser==0.6.3 \
  flask==3.1.3 flask-cors==6.0.5 blinker==1.9.0 itsdangerous==2.2.0
python3 - "$out" <<'PY'
import base64, csv, hashlib, io, pathlib, re, sys, zipfile

def prune(wheel: pathlib.Path, drop) -> None:
    src = zipfile.ZipFile(wheel)
    kept = [i for i in src.infolist() if not drop(i.filename)]
    record = next(i.filename for i in kept if i.filename.endswith(".dist-info/RECORD"))
    rows, buf = [], io.StringIO()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in kept:
            if info.filename == record:
                continue
            data = src.read(info)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((info.filename, f"sha256={digest}", len(data)))
        csv.writer(buf).writerows(rows + [(record, "", "")])
        dst.writestr(record, buf.getvalue())
    tmp.replace(wheel)

out = pathlib.Path(sys.argv[1])
ray = next(out.glob("ray-2.58.0-*.whl"))
prune(ray, lambda n: n.startswith(("ray/jars/", "ray/rllib/", "ray/serve/", "ray/llm/")) or n.endswith(".js.map"))
keep = re.compile(r"botocore/data/(s3|sts)/|botocore/data/[^/]+\.json$")
botocore = next(out.glob("botocore-*.whl"))
prune(botocore, lambda n: n.startswith("botocore/data/") and not keep.match(n))
total = sum(p.stat().st_size for p in out.glob("*.whl"))
print(f"{len(list(out.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")
PY
