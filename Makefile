# Two commands do all the set-up on a fresh machine: `make train` runs the default training (the tiny
# policy on the CPU, a few minutes) and `make test` runs the tests, each creating the virtual environment
# .venv and installing the requirements on first use. By hand, the same is
#     pip install -r requirements.txt && python train.py && pytest
# The venv is installed as CI installs it (.ci/run runs `make test`): torch and the Triton release
# it pairs with first (TORCH below; on a GPU machine pass TORCH="torch" for the default CUDA build),
# then requirements.txt, which finds torch there. ARGS passes options on: make train ARGS="--steps 10".
# `make test` also installs llm-compressor into the side folder LLMC (requirements-llmcompressor.txt says
# why and how), so that the comparison with its checkpoints runs; plain `pytest` skips that one test
# when the folder is absent.
VENV ?= .venv
LLMC ?= .llmcompressor
PYTHON ?= python3
TORCH ?= torch==2.13.0 triton==3.8.0
PIP_FLAGS ?= -q
ARGS ?=
PY := $(VENV)/bin/python

.PHONY: train test clean-venv

train: $(VENV)/.installed
	$(PY) train.py $(ARGS)

test: $(VENV)/.installed $(LLMC)/.installed
	QERL_LLMCOMPRESSOR=$(abspath $(LLMC)) $(PY) -m pytest $(ARGS)

# The stamp is rewritten when requirements.txt changes, so an edited requirement is installed again.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	$(PY) -m pip install $(PIP_FLAGS) $(TORCH)
	$(PY) -m pip install $(PIP_FLAGS) -r requirements.txt
	touch $@

# Again after the venv changes: pip check confirms that the venv's packages still meet llm-compressor's pins.
$(LLMC)/.installed: requirements-llmcompressor.txt $(VENV)/.installed
	rm -rf $(LLMC)
	$(PY) -m pip install $(PIP_FLAGS) --no-deps --target $(LLMC) -r requirements-llmcompressor.txt
	PYTHONPATH=$(abspath $(LLMC)) $(PY) -m pip check
	touch $@

clean-venv:
	rm -rf $(VENV) $(LLMC)
