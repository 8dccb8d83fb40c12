# Two commands are the whole set-up: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= -q --disable-pip-version-check

.PHONY: demo test bench lint clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip setuptools wheel

$(VENV)/.installed-demo: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install $(PIP_FLAGS) -e '.[all]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install $(PIP_FLAGS) -e '.[test]'
	touch $@ $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	$(VENV)/bin/faultlens demo

test: $(VENV)/.installed-test
	$(PY) -m pytest -q

bench: $(VENV)/.installed-test
	$(VENV)/bin/faultlens bench --quick

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
