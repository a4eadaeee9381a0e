#!/bin/bash
# One server A/B leg: start `treedraft serve` from source tree SRC on 127.0.0.1:PORT, run `treedraft loadtest`
# at concurrency 1 and 8 (8 MT-Bench requests x 256 tokens each, EOS ignored), stop the server, print the two rows.
# Run legs of the variants alternately (a, b, c, then c, b, a) and read the c8/c1 ratios: the machine is shared.
#   usage: benchmarks/serve_ab.sh NAME SRC PORT [serve args...]   (results in $OUT_DIR/lt-NAME, default /tmp)
#   e.g.   git archive BASE src | tar -x -C /tmp/base && benchmarks/serve_ab.sh base /tmp/base/src 18801
#          benchmarks/serve_ab.sh new $PWD/src 18802
set -u
cd "$(dirname "$0")/.."  # the repo root: loadtest finds MT-Bench in ../shared/data
name=$1; src=$2; port=$3; shift 3
PY=${PY:-.venv/bin/python}
out=${OUT_DIR:-/tmp}/lt-$name
rm -rf $out
PYTHONPATH=$src $PY -m treedraft.cli serve --weights int4 --max-batch 8 --host 127.0.0.1 --port $port "$@" > $out.server.log 2>&1 &
spid=$!
for i in $(seq 1 120); do curl -s http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
PYTHONPATH=$src $PY -m treedraft.cli loadtest --url http://127.0.0.1:$port --concurrency 1,8 --requests 8 --max-tokens 256 --ignore-eos --out $out > $out.log 2>&1
kill $spid; wait $spid 2>/dev/null
grep -E "^\| (1|8) " $out/report.md | sed "s/^/$name /"
