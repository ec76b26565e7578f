# gemscout — two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOBS ?= 2

.PHONY: setup demo test test-fast test-torchtitan bench evidence lint types clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev,qualify,deepspeed,megatron,torchft]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install gemscout with its harness and dev tools (torch==2.13.0 CPU)

demo: $(STAMP)  ## the quickstart campaign: 3 CPU ranks, SIGKILL at step 4, recover, seal, render
	rm -rf runs/quickstart runs/quickstart.html
	$(BIN)/qualify run quickstart --out runs/quickstart

test: $(STAMP)  ## the whole test suite (unit, real gloo process groups, end-to-end CLI)
	$(BIN)/pytest -n $(JOBS) --dist worksteal -q --durations=30 tests

test-fast: $(STAMP)  ## unit tests only
	$(BIN)/pytest -q tests/unit

TT := .venv-tt
$(TT)/.installed: pyproject.toml
	$(PY) -m venv $(TT)
	$(TT)/bin/pip install -q 'torch==2.13.0' torchtitan==0.3.0 triton==3.7.1
	$(TT)/bin/pip install -q -e '.[qualify]' 'torch==2.13.0'
	touch $@

test-torchtitan: $(STAMP) $(TT)/.installed  ## TorchTitan Trainer.train() on CPU under gemscout (separate .venv-tt, ~2.2 GB)
	$(BIN)/pytest -q tests/distributed/test_torchtitan_cpu.py

bench: $(STAMP)  ## GEMINI benchmarks vs memcpy, raw gloo and DCP; JSON in bench-results/
	$(BIN)/python -m qualification.bench.gemini --out bench-results/gemini.json

bench-goodput: $(STAMP)  ## goodput under a SIGKILL schedule: gemscout vs DCP async_save (Young/Daly) vs torchft; JSON in bench-results/
	$(BIN)/python -m qualification.bench.goodput --out bench-results/goodput.json

CAMPAIGNS ?= quickstart
evidence: $(STAMP)  ## from a clean clone at HEAD: run CAMPAIGNS, verify, copy to docs/evidence/, re-render the docs
	PYTHON=$(CURDIR)/$(BIN)/python scripts/regenerate_evidence.sh $(CAMPAIGNS)

lint: $(STAMP)  ## ruff check, and ruff format's layout (line length 100) on every Python file
	$(BIN)/ruff check src qualification tests scripts examples
	$(BIN)/ruff format --check src qualification tests scripts examples

types: $(STAMP)
	$(BIN)/mypy src/gemscout

# The examples users copy (examples/): each run, SIGKILLed mid-run, started again (a requeue) and checked bit for bit
# against an uninterrupted run by examples/run_kill.py.
.PHONY: example-ddp example-hf
example-ddp: $(STAMP)  ## plain DDP on a tiny model, 2 torchrun ranks: kill rank 1, restart, check (both restore modes)
	rm -rf runs/example-ddp
	$(BIN)/python examples/run_kill.py --script examples/ddp_tiny.py --work runs/example-ddp \
		--restore candidate --restore verified -- --scout-interval 2

example-hf: $(STAMP)  ## a transformers Llama (from a config) under DDP, 2 torchrun ranks: kill, restart, check
	rm -rf runs/example-hf
	$(BIN)/python examples/run_kill.py --script examples/hf_llama.py --work runs/example-hf --steps 8 --kill-step 5

clean:
	rm -rf $(VENV) runs bench-results .pytest_cache .mypy_cache .ruff_cache
