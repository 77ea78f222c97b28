# Two commands set up everything on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: install demo test test-fast docs bench bench-data lease-pack clean

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

# issue 62's GPU run (python -m benchmarks.lease, docs/guides/speed.md): what the lent machine lacks,
# put in git-ignored folders that the device tool carries. datasets 4.8: its pyarrow floor (21) fits the
# machine's own pyarrow, 5.x asks for 24, and pyarrow's 55 MB wheel would not fit the 64 MiB carried
LEASE_WHEELS = transformers==5.24.0 peft==0.21.2 trl==1.16.0 datasets==4.8.0 dill==0.4.1 multiprocess==0.70.19
NANOGPT ?= ../shared/peers/nanoGPT

lease-pack: install
	mkdir -p bench-peers/nanoGPT
	install -m 644 $(NANOGPT)/train.py $(NANOGPT)/model.py $(NANOGPT)/configurator.py bench-peers/nanoGPT/
	rm -rf .whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(LEASE_WHEELS)

clean:
	rm -rf $(VENV) runs .pytest_cache site
