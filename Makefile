# sparsecomm: every target bootstraps .venv by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch (on this machine it is installed from local disk; an open range would pull CUDA).
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.bootstrapped

.PHONY: venv test test-slow demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-slow: $(STAMP)
	$(PY) -m pytest -q -ra -m slow

demo: $(STAMP)
	$(VENV)/bin/sparsecomm demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
