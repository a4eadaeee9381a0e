# Data steps the two shipped-drafter recipes share (sourced by scripts/train_eagle_shipped.sh and
# scripts/train_heads_shipped.sh, in their output directory; needs T, PY, here and gen set). Every step resumes.
#
# shared_data_sets runs, in order:
#   data    the target's greedy int4 answers to the 2,640 ShareGPT prompts that fit;
#   tmpl    its answers to 1,600 template prompts over eight kinds of request (benchmarks/eagle_template_prompts.py,
#           session 18);
#   synth   its answers to requests it wrote itself (synth-prompts --num 4000, keys 0..3999: 3,253 kept in session 19;
#           SYNTH_PROMPTS= reuses benchmarks/results/heads-s19/synth_prompts.jsonl.gz gunzipped, with its meta.json);
#   synth2  the same for keys 4000..7999 of that file (session 20: 3,275 kept; SYNTH_PROMPTS2= reuses
#           benchmarks/results/heads-s20/synth_prompts_4000-7999.jsonl.gz gunzipped).
shared_data_sets() {
  "$T" train-eagle $gen --train-data data
  [ -f tmpl_prompts.jsonl ] || "$PY" "$here/benchmarks/eagle_template_prompts.py" --n 1600 --seed 0 \
    --out tmpl_prompts.jsonl
  "$T" train-eagle $gen --train-data tmpl --prompts tmpl_prompts.jsonl
  local sp sp2
  if [ -n "${SYNTH_PROMPTS:-}" ]; then sp="$SYNTH_PROMPTS"; else
    sp=synth_prompts.jsonl
    "$T" synth-prompts --weights int4 --threads 2 --num 4000 --seed 0 --out "$sp"
  fi
  "$T" train-eagle $gen --train-data synth --prompts "$sp"
  if [ -n "${SYNTH_PROMPTS2:-}" ]; then sp2="$SYNTH_PROMPTS2"; else
    sp2=synth2_prompts.jsonl
    if [ ! -f "$sp2" ]; then
      "$T" synth-prompts --weights int4 --threads 2 --num 8000 --seed 0 --out "$sp"  # continues the file
      "$PY" -c 'import json, sys
for line in open(sys.argv[1]):
    if json.loads(line)["key"] >= 4000: sys.stdout.write(line)' "$sp" > "$sp2.tmp"
      mv "$sp2.tmp" "$sp2"
    fi
  fi
  "$T" train-eagle $gen --train-data synth2 --prompts "$sp2"
}
