# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# The CPU wheels; the GPU path is documented in the README.
PIP_INSTALL := $(VPY) -m pip install --disable-pip-version-check -q

.PHONY: venv demo test test-unit test-integration bench bench-deps bench-gpu clean

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

# TorchRec, the benchmarks' baseline: torchrec==1.8.0 without its declared CUDA fbgemm-gpu dependency
# (the CPU pair torch 2.13.0 + fbgemm-gpu-cpu 1.8.0 stays), plus what it imports ([bench] extra).
$(VENV)/.bench: $(VENV)/.installed
	$(PIP_INSTALL) -e '.[bench]'
	$(PIP_INSTALL) --no-deps torchrec==1.8.0
	touch $@

bench-deps: $(VENV)/.bench

# Every benchmark of benchmarks/, one after another (figures and ratios go to BENCHMARKS.md by hand).
bench: bench-deps
	$(VPY) benchmarks/data_pipeline.py
	$(VPY) benchmarks/ps_table.py --kernels
	$(VPY) benchmarks/ps_throughput.py
	$(VPY) benchmarks/shm_segments.py
	$(VPY) benchmarks/shard_ops.py
	$(VPY) benchmarks/train_throughput.py
	$(VPY) benchmarks/train_distributed.py
	$(VPY) benchmarks/serving.py
	$(VPY) benchmarks/checkpoint.py
	$(VPY) benchmarks/preflight.py
	$(VPY) benchmarks/ray_overhead.py

# On a machine with a CUDA GPU (not part of `bench`, which runs anywhere): dense and row cache on the
# GPU, shards on the CPU cores, against TorchRec on the same GPU (needs torchrec + the CUDA fbgemm-gpu).
bench-gpu: bench-deps
	$(VPY) benchmarks/train_gpu.py

clean:
	rm -rf $(VENV) demo runs *.egg-info
