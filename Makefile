# Every target builds its own virtual environment; nothing outside .venv is touched.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export GLOO_SOCKET_IFNAME ?= lo

.PHONY: venv demo test test-oldest test-torch bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel of torch lies on this machine; an unpinned torch would pull a CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

# The trial sets OMP_NUM_THREADS=1, what torchrun sets anyway, so that torchrun does not warn so in each of its 12 runs.
demo: $(STAMP)
	$(BIN)/lagom-tune profile --workload cpu-demo --backend gloo --ranks 2 --out runs/demo-cpu
	$(BIN)/lagom-tune search runs/demo-cpu --optimizer lagom --out runs/demo-cpu/plan.yaml
	OMP_NUM_THREADS=1 $(BIN)/lagom-tune trial runs/demo-cpu/plan.yaml --rounds 6 --warmup 2 -- $(BIN)/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 8

# Two workers: run one at a time, most tests wait on processes they start (ranks, torchrun,
# `lagom-tune` itself) and kept 2 cores 57% busy; a module stays on one worker (its fixtures are made once).
PYTEST := -m pytest -q -n 2 --dist loadscope
test: $(STAMP)
	$(BIN)/python $(PYTEST)

# A by-hand environment $(1): pip, and a setuptools new enough for the packaging test (Python 3.11's venv has 65).
new_venv = $(PYTHON) -m venv $(1) && $(1)/bin/python -m pip install -q --upgrade pip "setuptools>=68"

# The same tests on the oldest releases pyproject.toml accepts (.ci/oldest.txt; torch 2.4.1 is a
# 5 GB CUDA build from PyPI): by hand, not in CI.
OLDEST := .venv-oldest
test-oldest:
	test -f $(OLDEST)/.installed || { $(call new_venv,$(OLDEST)) \
		&& $(OLDEST)/bin/python -m pip install -q -c .ci/oldest.txt -e ".[test,bench]" && touch $(OLDEST)/.installed; }
	$(OLDEST)/bin/python $(PYTEST)

# The same tests on another torch release, the rest the newest pyproject.toml accepts: by hand,
# `make test-torch TORCH=2.8.0` (from PyPI: a CUDA build of several GB; it runs on a CPU).
TORCH_VENV = .venv-torch-$(TORCH)
test-torch:
	test -n "$(TORCH)" || { echo "name the release: make test-torch TORCH=2.8.0"; exit 2; }
	test -f $(TORCH_VENV)/.installed || { $(call new_venv,$(TORCH_VENV)) \
		&& $(TORCH_VENV)/bin/python -m pip install -q "torch==$(TORCH)" && $(TORCH_VENV)/bin/python -m pip install -q -e ".[test,bench]" \
		&& touch $(TORCH_VENV)/.installed; }
	$(TORCH_VENV)/bin/python $(PYTEST)

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) $(OLDEST) .venv-torch-* runs .pytest_cache
