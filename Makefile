# Two commands set up everything on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: install demo test test-fast docs bench bench-data clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	$(BIN)/tfcli pretrain --objective clm --recipe gpt-mini

# a worker per core, a test file at a time, in the order tests/conftest.py gives (the longest first;
# xdist would otherwise start the files with the most tests first); each worker pinned to its own core
PARALLEL = -n auto --dist loadfile --no-loadscope-reorder

test: install
	$(BIN)/python -m pytest $(PARALLEL)

test-fast: install
	$(BIN)/python -m pytest $(PARALLEL) -m "not slow"

docs: install
	$(BIN)/mkdocs build --strict

bench: install
	$(BIN)/pip install -q -e ".[dev,bench]"
	$(BIN)/python -m benchmarks

bench-data: install
	$(BIN)/python -m benchmarks data

clean:
	rm -rf $(VENV) runs .pytest_cache site
