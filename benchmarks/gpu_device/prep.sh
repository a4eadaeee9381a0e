#!/usr/bin/env bash
# Prepares benchmarks/gpu_check.sh for the workplace's device tool (a lent CUDA machine), as run in session 28 on an
# H200 (benchmarks/results/gpu-check-s28-h200/). Two limits shape it: one call carries at most 64 MiB of working
# tree, and the model file is 98 MB. So the file travels xz-compressed in two halves (.gpu/a, .gpu/b, git-ignored
# through .git/info/exclude), the first half is copied to the machine's /tmp by one call (a carried path that the
# next call does not name is removed there) and the second call assembles it and runs the check.
#
#   bash benchmarks/gpu_device/prep.sh           # here, once: parts, the gguf wheel, the MT-Bench file
#   bash benchmarks/gpu_device/tree.sh hide      # benchmarks/results out of what travels (see below)
#   then, with the device tool, back to back (the machine is given back after 30 s idle):
#     run  command "bash benchmarks/gpu_device/call1.sh"  carry [".gpu/a", ".whl"]
#     run  command "bash benchmarks/gpu_device/call2.sh"  carry [".gpu/b", ".whl"]
#   bash benchmarks/gpu_device/tree.sh restore   # at once, before any commit
#
# The tracked tree itself must stay under the limit with a half beside it: in session 28 it was 71 MB, 55 MB of it
# benchmarks/results, which tree.sh takes out of the index and the work tree for the calls.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
model=$(PYTHONPATH=src "$PY" -c "from treedraft.models.registry import resolve; print(resolve('smollm2-135m-instruct'))")
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/a .gpu/b .gpu/m.xz && mkdir -p .gpu/a .gpu/b .whl  # (never all of .gpu: tree.sh keeps benchmarks/results there)
xz -T2 -6 -c "$model" > .gpu/m.xz
split -n 2 -d .gpu/m.xz .gpu/part. && mv .gpu/part.00 .gpu/a/ && mv .gpu/part.01 .gpu/b/ && rm .gpu/m.xz
sha256sum "$model" | cut -c1-64 > .gpu/b/model.sha256
cp ../shared/data/mt_bench_questions.jsonl .gpu/b/
"$PY" -m pip download -q --no-deps "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')" -d .whl
du -sh .gpu/a .gpu/b .whl
echo "tracked tree: $(git ls-files -z | xargs -0 cat | wc -c) bytes (+ one part must stay under 64 MiB)"
