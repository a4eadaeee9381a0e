#!/usr/bin/env bash
# Shrinks what a device call carries below its 64 MiB, and puts it back: benchmarks/results (55 MB of the 71 MB
# tracked in session 28) leaves the index and the work tree for the calls.
#
#   bash benchmarks/gpu_device/tree.sh hide      # before the device calls
#   bash benchmarks/gpu_device/tree.sh restore   # right after them (before any commit)
#
# hide refuses when anything is staged, so that restoring the index cannot drop other staged work.
set -euo pipefail
cd "$(dirname "$0")/../.."
away=.gpu/results-away
case "${1:-}" in
  hide)
    git diff --cached --quiet || { echo "tree.sh: something is staged; commit or unstage it first" >&2; exit 2; }
    [ -e "$away" ] && { echo "tree.sh: $away exists: restore first" >&2; exit 2; }
    mkdir -p .gpu
    git rm -r -q --cached benchmarks/results
    mv benchmarks/results "$away"
    echo "tracked tree now $(git ls-files -z | xargs -0 cat | wc -c) bytes; restore after the calls"
    ;;
  restore)
    [ -d "$away" ] || { echo "tree.sh: nothing to restore ($away is missing)" >&2; exit 2; }
    mv "$away" benchmarks/results
    git reset -q -- benchmarks/results
    git status --short benchmarks/results | head -5
    ;;
  *) echo "usage: tree.sh hide|restore" >&2; exit 2 ;;
esac
