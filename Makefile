# Two commands do all the set-up on a fresh machine: `make train` runs the default training (the tiny
# policy on the CPU, a few minutes) and `make test` runs the tests, each creating the virtual environment
# .venv and installing the requirements on first use. By hand, the same is
#     pip install -r requirements.txt && python train.py && pytest
# The venv is installed as CI installs it (.ci/run runs `make test`): torch and the Triton release
# it pairs with first (TORCH below; on a GPU machine pass TORCH="torch" for the default CUDA build),
# then requirements.txt, which finds torch there. ARGS passes options on: make train ARGS="--steps 10".
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0 triton==3.8.0
PIP_FLAGS ?= -q
ARGS ?=
PY := $(VENV)/bin/python

.PHONY: train test clean-venv

train: $(VENV)/.installed
	$(PY) train.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest $(ARGS)

# The stamp is rewritten when requirements.txt changes, so an edited requirement is installed again.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	$(PY) -m pip install $(PIP_FLAGS) $(TORCH)
	$(PY) -m pip install $(PIP_FLAGS) -r requirements.txt
	touch $@

clean-venv:
	rm -rf $(VENV)
