# The two commands of the README: `make run` and `make test`. Everything else is a helper.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# ray start / workers must stay on loopback on a single machine (docs/guide/troubleshooting.md).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
# Material for MkDocs prints a banner about its successor on every build
export NO_MKDOCS_2_WARNING := 1
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: run test test-fast typecheck fast-tests docs-check all-tests docs lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Re-install when the project's dependency list changes. setuptools' editable build warns, on
# every install, to beware of folders named like the package in the working directory (this
# repository is that directory): the filter keeps that notice off the user's terminal.
# pip byte-compiles everything it installs: this environment sets PYTHONDONTWRITEBYTECODE, so a
# module pip did not compile would be compiled again by every process that imports it
# (--no-compile was tried: docs/decisions/012-test-suite-tiers.md has what it cost).
# `make run` installs what running needs; `make test` (and docs, lint, bench) adds the dev extra.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# `make run PROFILE=flickr8k`: the same pipeline on a dataset profile, profiles/<name>/ (its own
# params.yaml, dvc.yaml and outputs; docs/guide/datasets.md)
PROFILE ?=
PROJECT := $(if $(PROFILE),profiles/$(PROFILE),.)

# One Ray head for every stage of the repro (pipeline/ray/head.py; stopped by PID, even on failure)
run: $(VENV)/.installed
	$(BIN)/python -m pipeline.ray.head --params $(PROJECT)/params.yaml -- \
		$(BIN)/dvc repro $(if $(PROFILE),$(PROJECT)/dvc.yaml)
	$(BIN)/sat summary --reports $(PROJECT)/reports

# mypy and the docs build run beside the tests: each is one process on one core, which the
# tests' first minutes (clusters and pipelines starting) leave partly idle
test: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory -j3 typecheck docs-check all-tests

docs-check: $(VENV)/.installed-dev
	$(BIN)/mkdocs build --strict --quiet

# two workers, each a whole module at a time (its servers, its cluster, its pipeline run):
# most tests wait on processes they started, so two share the two cores well. Modules go out
# longest first (tests/conftest.py); xdist would otherwise reorder them by their test counts
all-tests: $(VENV)/.installed-dev
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder

# The inner loop: lint, types and every test that is no real-path integration (tests/conftest.py:
# `--fast` leaves out the marked ones and fails a test over 5 CPU-seconds); mypy and the tests
# run side by side
test-fast: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory --output-sync=target -j2 typecheck fast-tests

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

fast-tests: $(VENV)/.installed-dev
	$(BIN)/pytest -n 2 --fast -q

# The documentation site (mkdocs.yml), rebuilt on every edit, on loopback only
docs: $(VENV)/.installed-dev
	$(BIN)/mkdocs serve -a 127.0.0.1:8000

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf data models reports ray_results mlflow.db mlartifacts site
