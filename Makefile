# Every target bootstraps .venv on first use; `pulumi up` uses the same .venv (Pulumi.yaml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The Python minors pyproject.toml's requires-python allows.
PYTHON_VERSIONS := 3.11 3.12

.PHONY: venv test test-fast demo lint clean clean-runs check-python mutation

venv: $(STAMP)

# Runs before every use of the venv (order-only: it never forces a reinstall). An existing .venv is
# judged by its own interpreter, so a .venv made by a wrong Python is named, with the way out.
check-python:
	@if [ -e $(PY) ]; then py=$(PY); \
	  fix="remove it (rm -rf $(VENV)) and run make again with PYTHON=python3.12"; \
	else py=$(PYTHON); \
	  fix="install Python 3.11 or 3.12 and pass it, e.g. make $(or $(MAKECMDGOALS),venv) PYTHON=python3.12"; \
	fi; \
	version=$$($$py -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || { \
	  echo "error: $$py does not run; $$fix" >&2; exit 1; }; \
	case " $(PYTHON_VERSIONS) " in *" $$version "*) ;; *) \
	  echo "error: $$py is Python $$version; this project needs 3.11 or 3.12: $$fix" >&2; exit 1;; \
	esac

$(STAMP): pyproject.toml | check-python
	@echo "Installing the project and its test tools into $(VENV): about 2.5 GB of wheels (torch with" \
	  "its CUDA libraries, ray, transformers, pulumi); 5-10 minutes the first time. pip's progress follows."
	@start=$$(date +%s); \
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || exit 1; \
	$(PY) -m pip install --progress-bar on -e '.[dev]' || exit 1; \
	touch $(STAMP); \
	echo "$(VENV) ready in $$(( $$(date +%s) - start )) s"

# pytest exits 5 when it collects no test; that is a failure here too.
test: $(STAMP)
	$(PY) -m pytest

# While working: every test but those marked slow (local Ray clusters, multi-process training), which
# `make test` (and CI) still runs.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

# Mutation testing of the core modules ([tool.mutmut] in pyproject.toml; docs/MUTATION.md): on
# demand, never part of `make test`. Narrow it with a glob, e.g. make mutation MUTANTS='workloads.train.optim*'.
# Tests run from a copy in mutants/, so the shared folder is passed by its absolute path.
MUTANTS ?=
mutation: $(STAMP)
	SHARED_DIR="$${SHARED_DIR:-$(abspath ..)/shared}" $(VENV)/bin/mutmut run $(MUTANTS)
	$(VENV)/bin/mutmut results

demo: $(STAMP)
	$(PY) -m workloads run --local

lint: $(STAMP)
	$(PY) -m ruff check .

# runs/ holds every demo's report, checkpoints and exported model: only clean-runs removes it.
clean:
	rm -rf $(VENV) .pytest_cache mutants

clean-runs:
	rm -rf runs
