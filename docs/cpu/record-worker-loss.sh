#!/usr/bin/env bash
# Reruns the worker-loss test (tests/test_fault_injection.py) N times in a row on this machine and
# records, per run, the line the test prints (kill step, resumed step, steps redone, kill to job end,
# wall time) and pytest's closing line. docs/RELIABILITY.md's table is read from that file.
#   docs/cpu/record-worker-loss.sh N OUT_FILE
set -uo pipefail
runs=$1 out=$2
cmd=(.venv/bin/python -m pytest tests/test_fault_injection.py -q -s -p no:cacheprovider)
{
  echo "\$ ${cmd[*]}   (x$runs; $(nproc) cores, $(uname -sm), $(date -u +%Y-%m-%dT%H:%MZ))"
  for i in $(seq 1 "$runs"); do
    echo "run $i:"
    "${cmd[@]}" 2>&1 | grep -E '^fault injection:|[0-9]+ (passed|failed)|^(FAILED|ERROR) '
  done
} | tee "$out"
