#!/usr/bin/env bash
# The shipped EAGLE drafter for smollm2-135m-instruct, reproduced by one command (`make train-eagle`, issue 12).
#
#   scripts/train_eagle_shipped.sh [OUT_DIR]      (default: eagle-train/ in the current directory)
#
# Every step is resumable: the data steps keep per-shard progress, a training step whose output directory already
# holds eagle.json is skipped (and an interrupted one resumes from its checkpoint). Stop and restart at will.
# The start is the session-7 file from git history (the steps before it: git log -- src/treedraft/heads), then
# warm epochs over the target's greedy answers and sampled answers (T 0.7) to the 2,640 ShareGPT prompts that fit.
# Wall time on a 2-core CPU: data ~11 min per set on a Zen 5 EPYC, ~35 min on a Zen 4; training 12-31 min per
# epoch on a Zen 5 (one or two threads), ~19 min per million rows on a Zen 4 (two threads; the last step has
# 2.07 M). Hours in all. The result is <OUT_DIR>/E20 (D7 was shipped before session 19, DM in session 19); compare
# it with the shipped file by
#   python benchmarks/eagle_heldout.py --data OUT_DIR/data --heldout 0.1 OUT_DIR/E20 src/treedraft/heads/smollm2-135m-instruct
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
T="${TREEDRAFT:-$here/.venv/bin/treedraft}"
PY="${PYTHON:-$here/.venv/bin/python}"
out="${1:-eagle-train}"
mkdir -p "$out"
cd "$out"

gen="--weights int4 --max-new-tokens 256 --shard-size 32 --gen-concurrency 8 --threads 2 --gen-only"
. "$here/scripts/shipped_data.sh"
shared_data_sets  # greedy ShareGPT, template and two self-written sets (data, tmpl, synth, synth2)
for s in 1 2; do "$T" train-eagle $gen --train-data data-t07-s$s --gen-temperature 0.7 --gen-seed $s; done

if [ ! -f s7/eagle.json ]; then
  rm -rf s7.tmp && mkdir -p s7.tmp
  for f in eagle.json eagle.safetensors; do
    git -C "$here" show c8843c3:src/treedraft/heads/smollm2-135m-instruct/$f > s7.tmp/$f
  done
  rm -rf s7 && mv s7.tmp s7  # whole or not at all: an interrupt here redoes the step
fi

common="--weights int4 --max-new-tokens 256 --shard-size 32 --gen-concurrency 8 --train-data data --no-generate
  --draft-vocab 4096 --epochs 1 --ce-weight 0.5 --tokens-per-batch 256 --heldout 0.1 --depth 4 --topk 4 --nodes 16
  --lr 3e-4"
step() {  # step OUT INIT THREADS UNROLL [extra train-eagle args]
  local o=$1 init=$2 threads=$3 unroll=$4
  shift 4
  if [ -f "$o/eagle.json" ]; then echo "train-eagle: $o done, skipped"; return; fi
  "$T" train-eagle $common --threads "$threads" --unroll "$unroll" --init-from "$init" --out "$o" "$@"
}
step a s7 1 2
step a2 a 1 2
step a3 a2 1 2
step a4 a3 1 3
step a5 a4 2 3 --extra-train-data data-t07-s1
step D7 a5 2 3 --extra-train-data data-t07-s1 --extra-train-data data-t07-s2

# session 19: one more epoch from D7 on greedy ShareGPT + the template set (session 18) + requests the model wrote
# itself (synth): ~60 min on two threads of the Zen 4 (1.9 M rows + the extra sets)
step DM D7 2 3 --extra-train-data tmpl --extra-train-data synth

# session 20: one more epoch from DM on 3,275 more self-written requests (synth2) + the template set + the first
# synthesized set (ShareGPT left out: seen for many epochs): ~60 min on two threads (1.95 M rows)
step E20 DM 2 3 --train-data synth2 --extra-train-data tmpl --extra-train-data synth

echo "train-eagle: done: $out/E20 (the shipped file)"
