# Two commands on a fresh machine:  `make demo` (set up + main job)  and  `make test` (set up + tests).
# CPU machines get torch==2.13.0 and triton==3.6.0 (for the Triton interpreter: kernels are tested on CPU).
# GPU machines: `make setup TORCH="torch --index-url https://download.pytorch.org/whl/cu128" TRITON=`
# (a CUDA build of torch >= 2.11 brings its own matching triton).
PYTHON ?= python3
TORCH ?= torch==2.13.0
TRITON ?= triton==3.6.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo speedrun test test-all bench clean

$(BIN)/k3: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH) $(TRITON)
	$(BIN)/pip install -q -e ".[test,data]"
	touch $@

setup: $(BIN)/k3

# The main job: train the tiny preset on this Python's standard library (~8 min on 2 CPU cores), write
# plots to runs/tiny/plots, then complete a Python prompt. Re-running continues the run after a stop (Ctrl-C
# saves a checkpoint) or, once it is complete, goes straight to the prompt: --auto-resume starts the run if
# runs/tiny holds none and resumes it otherwise.
demo: setup
	$(BIN)/k3 info --preset tiny
	$(BIN)/k3 train --preset tiny --out runs/tiny --time-budget 8 --auto-resume
	$(BIN)/k3 generate runs/tiny --escapes --prompt 'import os\n\n\ndef read_config(path):\n    ' --max-new-tokens 120

# The whole lifecycle at the tiny preset (pre-train, SFT, RL at three efforts, MOPD with QAT, draft, eval, serve):
# about an hour on 2 CPU cores, report card in runs/speedrun/report.md. Re-running continues at the first unfinished
# stage (docs/recipe.md).
speedrun: setup
	$(BIN)/k3 recipe run tiny --out runs/speedrun --resume

# two workers (pytest-xdist), a test file per worker, each with its share of the cores' threads (tests/conftest.py)
test: setup
	$(BIN)/pytest -q -n 2 --dist loadfile

test-all: setup
	K3_INTERPRETER_ALL=1 $(BIN)/pytest -q -n 2 --dist loadfile --runslow

bench: setup
	$(BIN)/python benchmarks/model_cpu.py

clean:
	rm -rf $(VENV) *.egg-info
