#!/usr/bin/env bash
# Final quiet-machine measurements, session 10 (AMD EPYC Zen 5, AVX-512 + VNNI, 2 cores; run from the repo
# root; sequential; logs in /work/final10). llama-cpp-python 0.3.36 built from source into .venv beforehand
# (CMAKE_ARGS="-DGGML_NATIVE=ON" pip wheel llama-cpp-python==0.3.36).
set -u
export PYTHONPATH=$PWD/src
PY=.venv/bin/python; TD=.venv/bin/treedraft
R=benchmarks/results
L=/work/final10
mkdir -p $L
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Flags" | cut -c1-400; uptime
loadtest() {  # name port requests
  $TD serve --weights int4 --max-batch 8 --host 127.0.0.1 --port $2 > $L/serve-$1.log 2>&1 &
  SP=$!
  for i in $(seq 120); do curl -sf http://127.0.0.1:$2/health >/dev/null && break; sleep 2; done
  $TD loadtest --url http://127.0.0.1:$2 --concurrency 1,8 --requests $3 --max-tokens 256 --ignore-eos --warmup 1 \
    --out $R/loadtest-s10-$1 2>&1 | grep -E "^\| (1|8) "
  kill $SP; wait $SP 2>/dev/null
}
for run in 1 2 3; do step loadtest r8 run $run; loadtest c1-c8-256-r8-run$run 1876$run 8; done
step loadtest r32; loadtest c1-c8-256-r32 18770 32
step bench 80x256 with llama.cpp
$TD bench --num-prompts 80 --max-new-tokens 256 --weights int4 --methods plain,hybrid-suffix,hybrid,prompt-lookup,llama.cpp --fresh-drafter-state --no-progress --out $R/bench-s10-80x256 2>&1 | tail -40
step forward_latency per weight format
$PY benchmarks/forward_latency.py --weights fp32,int4,int8 2>&1 | tail -14
step suffix_repeated 20
$PY benchmarks/suffix_repeated.py --prompts 20 --max-new 256 --weights int4 --cold-repeats 1 --passes turn1-cold,turn2,turn1-repeat --out $R/suffix_repeated-s10-20x256 2>&1 | tail -25
step done
