# posterior-bench: `make benchmark` runs the default experiment end to end, `make test` the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXPERIMENT ?= digits_optunet
STAMP := $(VENV)/.installed

.PHONY: install benchmark hmc test test-fast bench gpu-check wheels verify reliability slurm-up slurm-down clean

# The tested versions: requirements-offline.txt as pip constraints (torch 2.14.1 on x86_64, never a newer
# or a CUDA build pip would otherwise pick; pyproject.toml holds ranges). On Python 3.10, where some of
# those releases do not exist, only torch's and torchvision's.
CONSTRAINTS := $(VENV)/constraints.txt
$(STAMP): pyproject.toml requirements-offline.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then cp requirements-offline.txt $(CONSTRAINTS); \
	  else grep -E '^torch(vision)?==' requirements-offline.txt > $(CONSTRAINTS); fi
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The zoo and the sample stage are sharded over $(JOBS) local processes by Hydra's joblib
# launcher (cores // JOBS torch threads each, threads=auto); the final run, a single process on every
# core, finds that work done and does the rest.
# The method list comes from the registry (methods/registry.py: those in the default run).
JOBS ?= 2
# Extra overrides for every command of make benchmark / make hmc, e.g. on a GPU node
# make hmc ARGS='device=cuda methods@methods.hmc=hmc_gpu' (docs/hmc.md: the GPU preset).
ARGS ?=
METHODS ?= $(shell $(PY) -c 'import methods; print(",".join(methods.default_run_names()))')
HYDRA_MULTI := $(PY) -m benchmark -m experiment=$(EXPERIMENT) cluster.parallel_jobs=$(JOBS) $(ARGS)
# On a cluster (docs/cluster.md): make benchmark CLUSTER=slurm SHARDS=4 SLURM_ARGS='hydra.launcher.partition=<p>
# hydra.launcher.account=<a> hydra.launcher.gpus_per_node=0 hydra.launcher.cpus_per_task=2 hydra.launcher.mem_gb=8'
# submits the zoo as an array job of $(SHARDS) tasks and the sample stage as one of a task per method, then
# evaluate, report and analyze as one job (stage=finish: only the methods of $(METHODS) are drawn), waiting
# for each step; a job size that fits no node is refused before anything is submitted.
CLUSTER ?= local
SHARDS ?= $(JOBS)
SLURM_ARGS ?=
ifeq ($(CLUSTER),local)
SWEEP := $(HYDRA_MULTI)
FINAL := $(PY) -m benchmark experiment=$(EXPERIMENT) $(ARGS) stage=all
else
SWEEP := $(PY) -m benchmark -m cluster=$(CLUSTER) experiment=$(EXPERIMENT) $(SLURM_ARGS) $(ARGS)
FINAL := $(SWEEP) stage=finish
endif
benchmark: $(STAMP)
	$(SWEEP) stage=zoo zoo.num_shards=$(SHARDS) 'zoo.shard=range($(SHARDS))'
	$(SWEEP) stage=sample 'method=$(METHODS)'
	$(FINAL)

# Full-batch HMC as a second reference (docs/hmc.md): make benchmark's run, then
# HMC's multi-mode chains (the HMC reference) in $(JOBS) sample jobs that share the units' chains under
# claims (the zoo.shard sweep only starts $(JOBS) identical jobs; the sample stage does not read it), then
# every stage again scoring against the zoo and HMC (reference=hmc): metrics.csv rows with reference=hmc, table_hmc.md, the
# HMC claims of findings.md, figures/hmc*.png. Nothing already in the store is redone.
hmc: benchmark
	$(HYDRA_MULTI) stage=sample method=hmc mode=multi zoo.num_shards=$(JOBS) 'zoo.shard=range($(JOBS))'
	$(PY) -m benchmark experiment=$(EXPERIMENT) stage=all method=hmc mode=multi reference=hmc $(ARGS)

# One pytest-xdist worker per core (tests/conftest.py pins each to its core); TEST_JOBS=0 runs in this process.
# The 15 slowest tests are listed at the end of every run.
TEST_JOBS ?= logical
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15 tests

# The unit tests only (under a minute on 2 cores): no subprocess, no end-to-end run, no training of a zoo;
# those are marked slow (pyproject.toml) and run by make test.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not slow" --durations=10 tests

# Every bench/bench_*.py runs; those that record figures (bench/summary.py: record) add rows to
# the closing table of measured ratios and goals.
BENCH_SUMMARY := bench/_work/summary.jsonl
bench: $(STAMP)
	@mkdir -p bench/_work && rm -f $(BENCH_SUMMARY)
	@for f in bench/bench_*.py; do echo "== $$f"; BENCH_SUMMARY=$(BENCH_SUMMARY) $(PY) $$f || exit 1; done
	@echo "== summary" && $(PY) bench/summary.py $(BENCH_SUMMARY)

# On a CUDA host (docs/gpu.md): the CUDA test lane, every stage end to end on CUDA on small versions of
# the three experiments, the GPU speed bench, one closing table. No network and no .venv: the node's own
# Python and PyTorch ($(GPU_PYTHON)) with the project on PYTHONPATH and the wheels of `make wheels`
# installed in $(WHEELS_SITE) (the command below does it when wheels/ is there).
GPU_PYTHON ?= python3
WHEELS_SITE ?= /tmp/posterior-bench-site
gpu-check:
	@if [ -d $(WHEELS_DIR) ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(WHEELS_SITE) $(WHEELS_DIR)/*.whl; fi
	PYTHONPATH=$(CURDIR):$(WHEELS_SITE) $(GPU_PYTHON) bench/gpu_check.py

# Where the network is: the wheels of requirements-offline.txt for a GPU node's Python (default 3.12,
# x86_64 manylinux), into wheels/, to carry to the node; a package published only as source
# (antlr4-python3-runtime, pure Python) is built into a wheel here. torch is not downloaded: the node
# keeps its own (NODE_OWN); the x86_64 markers are dropped (the node is x86_64 whatever this machine is).
WHEELS_PYTHON ?= 3.12
WHEELS_DIR ?= wheels
SOURCE_ONLY := antlr4-python3-runtime
NODE_OWN := torch
wheels:
	grep -v -e '^#' $(foreach p,$(SOURCE_ONLY) $(NODE_OWN),-e '^$(p)==') requirements-offline.txt | sed -e 's/ *;.*//' > wheels.txt
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version $(WHEELS_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(WHEELS_DIR) -r wheels.txt
	$(PYTHON) -m pip wheel --no-deps -w $(WHEELS_DIR) $$(grep $(foreach p,$(SOURCE_ONLY),-e '^$(p)==') requirements-offline.txt)
	rm wheels.txt

# Check the whole store (every experiment under store/): complete, missing, quarantined, corrupt, stale.
verify: $(STAMP)
	$(PY) -m benchmark stage=verify experiment=$(EXPERIMENT) $(if $(REPAIR),verify.repair=$(if $(filter stale,$(REPAIR)),stale,true))

# SIGKILLs at random moments, 4 processes on overlapping seeds, 7 kinds of damage (a few minutes).
reliability: $(STAMP)
	$(PY) bench/reliability.py

# A single-node SLURM on this machine from Debian's packages (root; installs them if missing): munge, MariaDB,
# slurmdbd, slurmctld, slurmd, each stopped by its pid by slurm-down (.ci/slurm-up.sh; docs/cluster.md).
# make test runs the SLURM tests (tests/benchmark/test_slurm.py, marker slurm) against it; without it they skip.
slurm-up:
	.ci/slurm-up.sh

slurm-down:
	.ci/slurm-down.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
