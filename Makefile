# The README's commands. Each target sets up what it needs (venv, CPU torch, package) first.
PY ?= python3
VENV ?= .venv
# CPU machines take the local CPU wheel; GPU machines override, e.g. `make install TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install demo test lint gpu-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# the first 100 of the tiny recipe's 300 steps: a few minutes of CPU (the train loss falls from about 5.7 at
# step 10 to about 2.9 at step 60); each demo starts afresh in runs/demo (a fit from scratch is refused
# where an earlier run's checkpoints are)
demo: install
	rm -rf runs/demo
	$(BIN)/lightning-ffpa fit --config tiny --trainer.max_steps 100 --trainer.default_root_dir runs/demo

# two workers, one test file each at a time (a file's fixtures are built once); --durations: keeping CI short
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

gpu-test: install
	$(BIN)/python -m pytest -q -m gpu

lint: install
	$(BIN)/ruff check lightning_ffpa tests benchmarks examples

clean:
	rm -rf runs lightning_logs .pytest_cache build dist *.egg-info
