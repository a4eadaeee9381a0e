# device call 1 (carry .gpu/a .whl): keep the model's first half in /tmp, record the machine, run the CUDA unit tests
source benchmarks/gpu_device/env.sh
cp .gpu/a/part.00 /tmp/part.00
{ date; nvidia-smi -L; lscpu | grep 'Model name'; nproc
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.log"
PYTHONPATH=src:/tmp/site timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_gpu_check.py 2>&1 | tee "$OUT/pytest_device.log"
