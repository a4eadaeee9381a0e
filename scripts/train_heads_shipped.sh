#!/usr/bin/env bash
# The shipped Medusa heads for smollm2-135m-instruct, reproduced by one command (`make train-heads`).
#
#   scripts/train_heads_shipped.sh [OUT_DIR]      (default: heads-train/ in the current directory)
#
# Every step is resumable (the data steps keep per-shard progress; synth-prompts continues its file; a training step
# whose output already holds medusa.json is skipped). The start is the previous shipped heads from git history
# (session 6: 1,001 ShareGPT prompts x 192 tokens, fp32 runtime), then ONE epoch (lr 1e-3) on the int4 serving
# loop's own answers (train-eagle's data step: the hidden states the heads read when drafting) to
#   - the 2,640 ShareGPT prompts that fit (the same data step as scripts/train_eagle_shipped.sh),
#   - 1,600 template prompts over eight kinds of request (benchmarks/eagle_template_prompts.py, session 18),
#   - requests the model wrote itself (treedraft synth-prompts --num 4000: 3,253 kept in session 19),
# 1.55 M answer rows in all (5% of the sequences held out), evaluated on the MT-Bench first turns' answers (never trained on);
# then (session 20) one more epoch adding 4,000 more self-written requests (below).
# Wall time on the 2-core Zen 4 EPYC of session 19: data ~35 + 10 + 10 + 28 min, training ~30 min (one thread).
# Session 19 wrote its synthesized prompts in completion order (before synth-prompts wrote them in key order); that
# file is benchmarks/results/heads-s19/synth_prompts.jsonl.gz, used instead of drawing new ones when SYNTH_PROMPTS=
# points at it (gunzipped). Drawn anew the set is the same up to order (on this CPU), so the data are shuffled
# differently: expect heads of the same quality, not the same bytes. Compare with
#   python benchmarks/heads_eval.py --data OUT_DIR/mtb OUT_DIR/H src/treedraft/heads/smollm2-135m-instruct
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
T="${TREEDRAFT:-$here/.venv/bin/treedraft}"
PY="${PYTHON:-$here/.venv/bin/python}"
mtb="${MT_BENCH:-$here/../shared/data/mt_bench_questions.jsonl}"
out="${1:-heads-train}"
mkdir -p "$out"
cd "$out"

gen="--weights int4 --max-new-tokens 256 --shard-size 32 --gen-concurrency 8 --threads 2 --gen-only"
. "$here/scripts/shipped_data.sh"
shared_data_sets  # greedy ShareGPT, template and two self-written sets (data, tmpl, synth, synth2)
"$T" train-eagle $gen --train-data mtb --prompts "$mtb"

if [ ! -f start/medusa.json ]; then
  rm -rf start.tmp && mkdir -p start.tmp
  for f in medusa.json heads.safetensors; do
    git -C "$here" show d378cce:src/treedraft/heads/smollm2-135m-instruct/$f > start.tmp/$f
  done
  rm -rf start && mv start.tmp start  # whole or not at all: an interrupt here redoes the step
fi
if [ ! -f H/medusa.json ]; then
  "$T" train-heads --weights int4 --no-generate --train-data data --extra-train-data tmpl --extra-train-data synth \
    --eval-data mtb --init-from start --epochs 1 --lr 1e-3 --threads 1 --out H
fi

# session 20: one more epoch from H (lr 5e-4) on 4,000 more self-written requests (synth2: 3,275 kept) + the template
# set + the first synthesized set (ShareGPT left out: seen already): ~23 min here
if [ ! -f H20/medusa.json ]; then
  "$T" train-heads --weights int4 --no-generate --train-data synth2 --extra-train-data tmpl --extra-train-data synth \
    --eval-data mtb --init-from H --epochs 1 --lr 5e-4 --threads 1 --out H20
fi
echo "train-heads: done: $out/H20 (the shipped heads; the package ships them in fp16)"
