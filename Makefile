# Two commands on a fresh machine:  make train   (2-rank CPU training on the built-in corpus)
#                                   make test    (the test suite)
# make test-fast runs its unit and ranks tiers only (no DeepSpeed engine, no Hugging Face).
# Both create .venv and install into it first. On a CUDA machine, install your CUDA build of
# torch into .venv before `make install` (pip would otherwise keep the one you have).
# A regular (not editable) install: it carries the zero-code autoload hook, and is redone when
# the sources change.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
CPU_ENV := DS_ACCELERATOR=cpu OMP_NUM_THREADS=1

.PHONY: install train test test-fast clean

install: $(VENV)/.installed

SOURCES := setup.py ds_lowcomm_autoload.py ds_lowcomm_autoload.pth $(shell find ds_lowcomm -name '*.py' -o -name '*.json')

$(VENV)/.installed: $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: an unpinned torch requested by another package pulls GBs of CUDA wheels.
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install ".[test]"
	rm -rf build
	touch $@

train: install
	$(CPU_ENV) $(PY) -m torch.distributed.run --nproc_per_node 2 examples/train.py --deepspeed ds_configs/zero1.json

test: install
	$(CPU_ENV) $(PY) -m pytest -q tests

test-fast: install
	$(CPU_ENV) $(PY) -m pytest -q -m "unit or ranks" tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
