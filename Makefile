# sparsecomm: every target bootstraps .venv by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch (on this machine it is installed from local disk; an open range would pull CUDA).
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.bootstrapped

# Offline data from Debian packages (Fashion-MNIST, fortunes text: `fortunes` holds most of the word
# corpus of the LSTM workload); skipped where apt or root is missing:
# the commands that need them then say how to install them.
DATA_PACKAGES := dataset-fashion-mnist fortunes-min fortunes

.PHONY: venv data lint test test-slow test-faults test-gpu demo clean accuracy-table benchmarks-page

venv: $(STAMP)

data:
	@if [ -d /usr/share/datasets/fashion-mnist ] && [ -f /usr/share/games/fortunes/computers ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(DATA_PACKAGES) >/dev/null) || echo "warning: could not install $(DATA_PACKAGES); tests needing them skip"; \
	else echo "note: install the Debian packages $(DATA_PACKAGES) for the Fashion-MNIST and fortunes data"; fi

# the package and, beside it, the lab (lab/: benches, workloads, campaigns, demo; not in the wheel)
$(STAMP): pyproject.toml setup.py lab/pyproject.toml sparsecomm/selection/_scan.c sparsecomm/transport/_merge.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q -e lab
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check sparsecomm lab tests examples
	$(VENV)/bin/mypy

test: $(STAMP) data lint
	$(PY) -m pytest -q -ra

test-slow: $(STAMP) data
	$(PY) -m pytest -q -ra -m slow

# On a machine with a CUDA GPU and a CUDA build of torch (with Triton): the CUDA path's tests. Where the
# environment already holds torch (a GPU image), `make test-gpu PY=python3` runs them without the venv.
test-gpu:
	$(PY) -m pytest -q -ra -m gpu tests/test_gpu.py

test-faults: $(STAMP)
	$(PY) -m pytest -q -ra -m faults

demo: $(STAMP) data
	$(VENV)/bin/sparsecomm demo

# the accuracy table `sparsecomm advise` judges candidates by, built from the campaigns' records
accuracy-table: $(STAMP)
	$(PY) -m sparsecomm.simulator.accuracy $(sort $(wildcard benchmarks/campaign-*/summary.json))

# docs/benchmarks.md, from the benchmark folders (their commands, conditions and main tables)
benchmarks-page: $(STAMP)
	$(PY) benchmarks/make_page.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
