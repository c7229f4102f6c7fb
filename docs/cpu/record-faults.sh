#!/usr/bin/env bash
# Reruns a fault test file N times in a row on this machine and records, per run, the lines its
# tests print (what was injected, the step resumed from, steps redone, times) and pytest's closing
# line. docs/RELIABILITY.md's tables are read from that file.
#   docs/cpu/record-faults.sh tests/test_cluster_faults.py N OUT_FILE [PYTEST_ARGS...]
#     (save, node, head, and the Spot rehearsal's figures; -k 'not drained' leaves the rehearsal out)
set -uo pipefail
tests=$1 runs=$2 out=$3
cmd=(.venv/bin/python -m pytest "$tests" -q -s -n 0 -p no:cacheprovider "${@:4}")  # -n 0: -s shows the lines only without xdist workers
{
  echo "\$ ${cmd[*]}   (x$runs; $(nproc) cores, $(uname -sm), $(date -u +%Y-%m-%dT%H:%MZ))"
  for i in $(seq 1 "$runs"); do
    echo "run $i:"
    "${cmd[@]}" 2>&1 | grep -E '^(save kill|node loss|node gone|head loss):|^\[spot-rehearsal\] |[0-9]+ (passed|failed)|^(FAILED|ERROR) '
  done
} | tee "$out"
