# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# The CPU wheels; the GPU path is documented in the README.
PIP_INSTALL := $(VPY) -m pip install --disable-pip-version-check -q

.PHONY: venv demo test test-unit test-integration bench clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/recsys demo --out demo

test: venv
	OMP_WAIT_POLICY=PASSIVE $(VPY) -m pytest -q tests

test-unit: venv
	OMP_WAIT_POLICY=PASSIVE $(VPY) -m pytest -q tests/unit

bench: venv
	$(VPY) benchmarks/data_pipeline.py
	$(VPY) benchmarks/ps_throughput.py

clean:
	rm -rf $(VENV) demo runs *.egg-info
