#!/usr/bin/env bash
# Final quiet-machine measurements, session 9 (AMD EPYC Zen 5, AVX-512 + VNNI; run from the repo root;
# sequential; logs in /work/final9). llama-cpp-python 0.3.36 built from source into .venv beforehand
# (CMAKE_ARGS="-DGGML_NATIVE=ON" pip wheel llama-cpp-python==0.3.36, ~7 min here).
set -u
export PYTHONPATH=$PWD/src
PY=.venv/bin/python; TD=.venv/bin/treedraft
R=benchmarks/results
L=/work/final9
mkdir -p $L
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Flags" | cut -c1-400; uptime
step bench 80x256 with llama.cpp
$TD bench --num-prompts 80 --max-new-tokens 256 --weights int4 --methods plain,hybrid-suffix,hybrid,prompt-lookup,llama.cpp --fresh-drafter-state --no-progress --out $R/bench-s9-80x256 2>&1 | tail -40
step loadtest c1 c8
$TD serve --weights int4 --max-batch 8 --host 127.0.0.1 --port 18751 > $L/serve.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:18751/health >/dev/null && break; sleep 2; done
$TD loadtest --url http://127.0.0.1:18751 --concurrency 1,8 --requests 8 --max-tokens 256 --ignore-eos --warmup 1 --out $R/loadtest-s9-c1-c8-256 2>&1 | tail -12
kill $SP; wait $SP 2>/dev/null
step rows_profile
$PY benchmarks/rows_profile.py 2>&1 | tail -12
step fused_latency
$PY benchmarks/fused_latency.py --reps 15 2>&1 | tail -14
step suffix_repeated 20
$PY benchmarks/suffix_repeated.py --prompts 20 --max-new 256 --weights int4 --cold-repeats 1 --passes turn1-cold,turn2,turn1-repeat --out $R/suffix_repeated-s9-20x256 2>&1 | tail -25
step done
