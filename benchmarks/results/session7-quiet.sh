#!/usr/bin/env bash
# Final quiet-machine measurements, session 7 (run from /work/main; sequential; logs in /work/final7)
set -u
cd /work/main
export PYTHONPATH=$PWD/src
PY=.venv/bin/python; TD=.venv/bin/treedraft
R=benchmarks/results
L=/work/final7
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
lscpu | grep -E "Model name|^CPU\(s\)|Thread" ; uptime
step bench 20x256
$TD bench --num-prompts 20 --max-new-tokens 256 --weights int4 --methods plain,hybrid-suffix,prompt-lookup,llama.cpp --fresh-drafter-state --no-progress --out $R/bench-s7-20x256 2>&1 | tail -30
step loadtest
$TD serve --weights int4 --max-batch 8 --host 127.0.0.1 --port 18741 > $L/serve.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:18741/health >/dev/null && break; sleep 2; done
# each request its own prompt (the new default): no level drafts or prefills from an earlier level's answers
$TD loadtest --url http://127.0.0.1:18741 --concurrency 1,8 --requests 8 --max-tokens 256 --ignore-eos --warmup 1 --out $R/loadtest-s7-c1-c8-256 2>&1 | tail -12
kill $SP; wait $SP 2>/dev/null
# the same server code as at the session's start (f3a5a14: before the prefix cache and the propose-aware row
# budget), same client and prompts: does the batched decode path differ? (git archive f3a5a14 src | tar -x -C /work/base7)
PYTHONPATH=/work/base7/src $PY -m treedraft.cli serve --weights int4 --max-batch 8 --host 127.0.0.1 --port 18743 > $L/serve-base.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:18743/health >/dev/null && break; sleep 2; done
$TD loadtest --url http://127.0.0.1:18743 --concurrency 1,8 --requests 8 --max-tokens 256 --ignore-eos --warmup 1 --out $R/loadtest-s7-c1-c8-256-base-f3a5a14 2>&1 | tail -12
kill $SP; wait $SP 2>/dev/null
# the sessions 4-6 method (every level resends the same 8 prompts), on a fresh server: for comparison only
$TD serve --weights int4 --max-batch 8 --host 127.0.0.1 --port 18742 > $L/serve2.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:18742/health >/dev/null && break; sleep 2; done
$TD loadtest --url http://127.0.0.1:18742 --concurrency 1,8 --requests 8 --max-tokens 256 --ignore-eos --warmup 1 --repeat-prompts --out $R/loadtest-s7-c1-c8-256-repeat 2>&1 | tail -12
kill $SP; wait $SP 2>/dev/null
step suffix_repeated 20
$PY benchmarks/suffix_repeated.py --prompts 20 --max-new 256 --weights int4 --cold-repeats 1 --passes turn1-cold,turn2,turn1-repeat --out $R/suffix_repeated-s7-20x256 2>&1 | tail -25
step eagle bench 6x128
$TD bench --num-prompts 6 --max-new-tokens 128 --weights int4 --methods plain,eagle,eagle-lookup,hybrid-suffix,hybrid-eagle --no-progress --out $R/bench-s7-eagle-6x128 2>&1 | tail -20
step eagle profile full tree
$PY benchmarks/eagle_profile.py --prompts 6 --tokens 128 --nodes 32 --full-tree 2>&1 | tail -3
step done
