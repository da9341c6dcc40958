# Set-up and entry points. `make demo` and `make test` do everything on a fresh machine.
#
# torch is installed first, pinned, so that bunsan's `torch>=2.4` requirement is already
# met and pip does not pull a CUDA build of several GB. On a GPU machine choose another
# build: `TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>" make test`.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bunsan-installed

.PHONY: demo test test-all lint docs bench golden golden-update bench-docs bench-docs-dry-run clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/bunsan run -np 2 examples/train_digits_distributed.py

test: lint
	$(PY) -m pytest

test-all: lint
	$(PY) -m pytest -m "not gpu"

# ruff (lint and format) and mypy, versions pinned in the test extra; configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check bunsan tools
	$(VENV)/bin/ruff check --select F tests examples  # pyflakes: undefined names, unused imports
	$(VENV)/bin/ruff format --check bunsan tests examples tools
	$(VENV)/bin/mypy
	$(PY) tools/check_docs.py        # README and docs/: no lab notebook, short paragraphs, links resolve
	$(PY) tools/gen_reference.py --check  # docs/reference/ is what the code generates

# docs/reference/ regenerated from the code (signatures, docstrings, argparse, the env-var table).
docs: $(STAMP)
	$(PY) tools/gen_reference.py

bench: $(STAMP)
	$(VENV)/bin/bunsan run -np 2 $(PY) -m bunsan.bench.ddp_overhead

# Golden runs (tests/golden): short deterministic trainings stored in tests/golden/values.json.
# `make test` checks them; after an intended change in training dynamics, regenerate and commit.
golden: $(STAMP)
	$(PY) -m tests.golden --verbose

golden-update: $(STAMP)
	$(PY) -m tests.golden --update --verbose

# Every benchmark table and plot of README.md and docs/benchmarks.md, measured again at this
# commit and written between their <!-- bench:NAME --> markers (bunsan/bench/report.py), each
# stamped with its command, commit, date, machine and load; the shaped-network blocks need root.
bench-docs: $(STAMP)
	$(PY) -m bunsan.bench.report

bench-docs-dry-run: $(STAMP)
	$(PY) -m bunsan.bench.report --dry-run

clean:
	rm -rf $(VENV) build *.egg-info
