# Every target bootstraps .venv on first use; `pulumi up` uses the same .venv (Pulumi.yaml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo lint clean mutation

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# pytest exits 5 when it collects no test; that is a failure here too.
test: $(STAMP)
	$(PY) -m pytest

# Mutation testing of the core modules ([tool.mutmut] in pyproject.toml; docs/MUTATION.md): on
# demand, never part of `make test`. Narrow it with a glob, e.g. make mutation MUTANTS='workloads.train.optim*'.
# Tests run from a copy in mutants/, so the shared folder is passed by its absolute path.
MUTANTS ?=
mutation: $(STAMP)
	SHARED_DIR="$${SHARED_DIR:-$(abspath ..)/shared}" $(VENV)/bin/mutmut run $(MUTANTS)
	$(VENV)/bin/mutmut results

demo: $(STAMP)
	$(PY) -m workloads run --local

clean:
	rm -rf $(VENV) runs .pytest_cache mutants
