# Every target bootstraps .venv on first use; `pulumi up` uses the same .venv (Pulumi.yaml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# pytest exits 5 when it collects no test; that is a failure here too.
test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) -m workloads run --local

clean:
	rm -rf $(VENV) runs .pytest_cache
