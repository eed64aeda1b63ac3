# Every target creates the virtualenv it needs (.venv) and installs the project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick lint clean bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# cuda: NCCL, cuBLAS and the CUDA runtime wheels, so the CUDA output is compiled and linked
	# with nvcc in the tests (where nvcc is installed); nothing here needs a GPU.
	$(PY) -m pip install -q -e '.[cpu,cuda,test]'
	# PyTorch (CPU build, from local disk here) is only for baselines and interop tests.
	$(PY) -m pip install -q torch==2.13.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/coconetc run examples/adam.ccn --ranks 4 --schedule all --size N=4099

RUFF := $(VENV)/bin/ruff check coconetc tests cmake bench
MYPY := $(VENV)/bin/mypy coconetc

lint: $(STAMP)
	$(RUFF)
	$(MYPY)

# each test file runs on one worker (its fixtures' builds once), the longest files first
# (tests/durations.json, conftest.py), so that the two workers end together
PYTEST_DIST ?= -n 2 --dist loadfile --no-loadscope-reorder

# coconetc's bytecode (and the tests' helper modules') written before the run: the suite starts
# about 900 processes that import coconetc (ranks, CLI runs), and where PYTHONDONTWRITEBYTECODE
# is set Python never writes it, so each compiled every module again (about 0.25 s of CPU each)
BYTECODE := $(PY) -m compileall -q coconetc tests

# The tests run with lint: ruff first (a second), mypy (one core, about 15 s from a cold cache)
# beside pytest, whose two workers leave a core idle part of the time; either failing fails.
WITH_MYPY = $(MYPY) > $(VENV)/mypy.log 2>&1 & mypy=$$!; $(1); rc=$$?; wait $$mypy; m=$$?; \
	cat $(VENV)/mypy.log; exit $$(( rc ? rc : m ))

test: $(STAMP)
	$(RUFF)
	$(BYTECODE)
	$(call WITH_MYPY,$(PY) -m pytest $(PYTEST_DIST) --durations=30 tests)

# while working: everything but the cases marked slow (installs, CMake and nvcc builds, random
# programs, the C++ runtime's own test program, and compiled end-to-end checks whose feature a
# quick case already compiles)
test-quick: $(STAMP)
	$(RUFF)
	$(BYTECODE)
	$(call WITH_MYPY,$(PY) -m pytest $(PYTEST_DIST) -m "not slow" tests)

# every benchmark on 2 ranks (the pipeline stage on 4: two groups of 2; pipeline parallelism on 4:
# P = 2 and 4 stages; the Adam step once more on 4
# ranks as 2 simulated nodes: hierarchical against flat and one node), side by side in one run
# each; tables on stdout, JSON and PNG plots in bench/results/ (docs/performance.md)
BENCH_ARGS ?=
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/adam_step.py $(BENCH_ARGS)
	$(PY) bench/adam_step.py --ranks 4 --nodes 2
	$(PY) bench/adamw_step.py $(BENCH_ARGS)
	$(PY) bench/lamb_step.py $(BENCH_ARGS)
	$(PY) bench/mlp_out.py --dtype f16
	$(PY) bench/mlp_out.py --dtype f32
	$(PY) bench/mlp_out.py --dtype bf16
	$(PY) bench/stage_step.py
	$(PY) bench/tp_mlp.py --dtype f32
	$(PY) bench/tp_mlp.py --dtype bf16
	$(PY) bench/gpt_block.py --sdpa
	$(PY) bench/pipeline.py --json bench/results/pipeline_f32.json
	$(PY) bench/stage_program.py --json bench/results/stage_program.json
	$(PY) bench/attention_cpu.py
	$(PY) bench/call_overhead.py
	$(PY) bench/warm_load.py
	$(PY) bench/collectives.py
	$(PY) bench/train_step.py --size 3M
	$(PY) bench/train_step.py --size 10M
	$(PY) bench/sharded.py
	$(PY) bench/prefetch.py
	$(PY) bench/block_threads.py
	$(PY) bench/blas.py

clean:
	rm -rf $(VENV) build *.egg-info
