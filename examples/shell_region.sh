#!/bin/sh
# A shell benchmark: only the timed command runs inside a region.
# Run as a managed job: krex run -- sh examples/shell_region.sh
set -e
reps=${1:-4}
PY=${KREX_PYTHON:-python3}
i=0
while [ "$i" -lt "$reps" ]; do
  "$PY" -c 'sum(range(200000))'                       # untimed set-up, runs concurrently
  "$PY" -m krex region --label shell-timed -- "$PY" -c 'sum(range(400000))'
  i=$((i + 1))
done
echo "shell_region: $reps regions"
