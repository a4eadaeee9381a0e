#!/bin/bash
# old (15c0a24: draft forwards one request after another) vs new (packed), fp32, hybrid-draft, c1 and c4, alternating
cd /work/main
out=/work/runs/s39/batch_ab2; mkdir -p $out
for r in 1 2; do
  for v in old new; do
    if [ $v = old ]; then pp=/work/scratch/s39/wt_old/src; else pp=/work/main/src; fi
    PYTHONPATH=$pp .venv/bin/python benchmarks/batch_throughput.py --weights fp32 --concurrency 1,4 --drafter hybrid-draft \
      --prompts 8 --tokens 128 --rounds 1 --variants new > $out/$v-$r.log 2>&1
    echo "$v $r done $(date +%T)"
  done
done
PYTHONPATH=/work/main/src .venv/bin/python benchmarks/batch_throughput.py --weights fp32 --concurrency 1,4 --drafter none --variants new \
  --prompts 8 --tokens 128 --rounds 1 > $out/none.log 2>&1
echo "all done $(date +%T)"
