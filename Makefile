# kv-canary developer commands. `make test` works on a fresh clone (it creates .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup generate check-generated test demo lint bench

setup: $(STAMP)

# Reinstall only when the project metadata changes; torch is pinned to the CPU wheel (see pyproject).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

generate: $(STAMP)
	$(PY) -m codegen generate

check-generated: $(STAMP)
	$(PY) -m codegen check

test: setup check-generated
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check codegen kv_canary tests

demo: $(STAMP)
	$(PY) -m kv_canary demo
