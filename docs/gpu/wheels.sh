#!/usr/bin/env bash
# Wheels for a GPU host without network (Python 3.12, torch/pyarrow/aiohttp/grpcio already installed):
# Ray 2.58 with what its Jobs API and Ray Train need, and moto's S3 server for the rehearsal's checkpoint
# storage. Run where pip reaches PyPI:  docs/gpu/wheels.sh DIR   (about 63 MB once pruned)
# Pruned to fit a 64 MiB transfer: Ray's Java jars, source maps, RLlib, Serve and LLM packages, and
# every botocore service model but S3's and STS's (RECORD files rewritten so pip installs them).
# On the host: python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
set -euo pipefail
out=${1:?usage: docs/gpu/wheels.sh DIR}
mkdir -p "$out"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$out" ray==2.58.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
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
