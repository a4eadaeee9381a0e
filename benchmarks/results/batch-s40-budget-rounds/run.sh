#!/bin/bash
# alternate old/new code processes: batch_throughput with the given args; output per run in $OUT
OLD=${OLD:?a worktree of the old commit}; OUT=$1; shift; N=$1; shift
mkdir -p $OUT
cd /work/main
for r in $(seq 1 $N); do
  for v in old new; do
    if [ $v = old ]; then PP=$OLD/src; else PP=/work/main/src; fi
    PYTHONPATH=$PP .venv/bin/python benchmarks/batch_throughput.py "$@" > $OUT/$v-$r.log 2>&1
    echo "$v $r $(grep -c MISMATCH $OUT/$v-$r.log) $(grep '"variant"' $OUT/$v-$r.log | python3 -c '
import sys,json
for l in sys.stdin:
    d=json.loads(l); print(d["c"], d["tok/s"], d["mean accepted"], end=" | ")')"
  done
done
