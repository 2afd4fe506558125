# loadout: `make train` and `make test` do all the set-up on a fresh machine. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= data/synthetic
SEED_DATA ?= data/synthetic-320
PHOTO_DATA ?= data/photos-12mp
IMAGENET_DATA ?= data/synthetic-500
VOC_DATA ?= data/synthetic-voc
VOC_SEED_DATA ?= data/synthetic-voc-320
REAL_DATA ?= data/photos-500
PEERS_VENV ?= .venv-peers
ARGS ?=
NPROC ?= 2
MIN_PYTHON := 3.11

.DEFAULT_GOAL := help
.PHONY: help setup setup-dev lock dataset train test test-fast lint test-container torchrun slurm gpu-check gpu-wheels bench bench-peers soak tune tensorboard clean

help: ## List the targets
	@if [ -t 1 ]; then on='\033[36m'; off='\033[0m'; fi; \
	grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) \
	  | awk -v on="$$on" -v off="$$off" 'BEGIN {FS = ":.*## "}; {printf "  %s%-15s%s %s\n", on, $$1, off, $$2}'

# Two install stamps. .installed: what training needs, requirements.txt and loadout (editable), every version from
# the lock; `make train` stops there. .installed-dev: that plus the dev extras (pytest, ruff, moto, the optional
# trackers, timm, ...), which the tests, lint and benchmarks need; its recipe installs both at once and touches both
# stamps, so `make test` on a fresh clone resolves once, and `make train` after it has nothing to do.
define make_venv
	@v=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
	  && [ "$$(printf '%s\n' $(MIN_PYTHON) "$$v" | sort -V | head -1)" = $(MIN_PYTHON) ] \
	  || { echo "error: loadout needs Python >= $(MIN_PYTHON) (the lock's numpy and matplotlib do); $(PYTHON) is" \
	       "$${v:-missing}: install python$(MIN_PYTHON) and run make PYTHON=python$(MIN_PYTHON) $(MAKECMDGOALS)" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
endef

$(VENV)/.installed: pyproject.toml requirements.txt constraints.txt
	$(make_venv)
	$(PY) -m pip install --quiet -c constraints.txt -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml requirements.txt constraints.txt
	$(make_venv)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(VENV)/.installed $@

setup: $(VENV)/.installed ## Create .venv and install what training needs (requirements.txt, every version from the lock)

setup-dev: $(VENV)/.installed-dev ## setup, plus the dev extras the tests, lint and benchmarks use (make test does it)

lock: setup ## Re-lock constraints.txt after editing requirements.txt or pyproject.toml's extras (keeps existing pins, torch's too)
	$(PY) -m pip install --quiet pip-tools
	$(VENV)/bin/pip-compile --quiet --extra dev --strip-extras --allow-unsafe --no-emit-index-url \
	  --no-emit-find-links --output-file constraints.txt pyproject.toml

$(DATA)/.complete: | $(VENV)/.installed
	$(PY) scripts/make_dataset.py --out $(DATA)

$(VOC_DATA)/.complete: | $(VENV)/.installed
	$(PY) scripts/make_dataset.py --task segmentation --out $(VOC_DATA)

dataset: $(DATA)/.complete $(VOC_DATA)/.complete ## Make the embedded datasets (classification ImageFolder, segmentation VOC) if missing

train: setup dataset ## Train on the embedded dataset (ARGS="hardware=cpu trainer.epochs=2" to override)
	$(PY) -m train $(ARGS)

torchrun: setup dataset ## Train with torchrun on this box: make torchrun NPROC=2 ARGS="hardware=cpu trainer.epochs=1"
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m train $(ARGS)

# Two pytest processes, each test file whole in one of them (its module fixtures made once): most tests wait on the
# processes, servers and timeouts they start, so two keep a 2-core box busy (bench/RESULTS.md, "Tests and CI").
# TEST_WORKERS=0 runs every test in one process.
TEST_WORKERS ?= 2
test: setup-dev ## Run the test suite (lint included)
	$(PY) -m ruff check loadout train scripts tests bench examples
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-fast: setup-dev ## Run the tests not marked slow
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: setup-dev ## ruff on the Python sources
	$(PY) -m ruff check loadout train scripts tests bench examples

gpu-check: setup-dev ## On a GPU box: CUDA tests, GPU profiles, one-rank DDP, resume, fp16, compile, decode=device (ARGS="--only a100"; offline: docs/gpu.md)
	$(PY) scripts/gpu_check.py $(ARGS)

gpu-wheels: setup ## Wheels an offline GPU box with torch preinstalled lacks for gpu_check, in .gpu-wheels/ (docs/gpu.md)
	$(PY) scripts/gpu_wheels.py

slurm: ## Start a one-node Slurm here (root; installs slurm-wlm + munge) to try scripts/slurm/train.sbatch
	bash tests/infra/slurm_local_cluster.sh start

test-container: setup-dev dataset ## Build the image (stand-in base when the real one can't be pulled) and run compose for real
	bash tests/infra/test_container.sh

TB_HOST ?= 127.0.0.1
TB_PORT ?= 6006
tune: setup dataset ## Sweep loader knobs on this box (SWEEP="data.num_workers=0,4" to choose; ARGS="tune.autotune=true" writes hardware=local)
	$(PY) -m train.tune -m data.root=$(DATA) $${SWEEP:-$$($(PY) -c 'from loadout.tune.sweep import default_sweep; print(default_sweep())')} $(ARGS)

tensorboard: setup ## Serve outputs/ in TensorBoard on http://127.0.0.1:6006 (TB_HOST=0.0.0.0 to share it)
	$(VENV)/bin/tensorboard --logdir outputs --host $(TB_HOST) --port $(TB_PORT)

$(SEED_DATA)/.complete: | $(VENV)/.installed
	$(PY) scripts/make_dataset.py --out $(SEED_DATA) --size 320 --train-per-class 60 --val-per-class 5

$(VOC_SEED_DATA)/.complete: | $(VENV)/.installed
	$(PY) scripts/make_dataset.py --task segmentation --out $(VOC_SEED_DATA) --size 320 --train-per-class 400 --val-per-class 20

$(PHOTO_DATA)/.complete: | $(VENV)/.installed
	$(PY) scripts/make_dataset.py --out $(PHOTO_DATA) --photo 4032x3024 --train-per-class 5 --val-per-class 1

$(IMAGENET_DATA)/.complete: | $(VENV)/.installed
	$(PY) scripts/make_dataset.py --out $(IMAGENET_DATA) --size 500 --train-per-class 20 --val-per-class 2

$(REAL_DATA)/.complete: | $(VENV)/.installed-dev
	$(PY) scripts/make_photos.py --out $(REAL_DATA)

bench: setup-dev dataset $(SEED_DATA)/.complete $(VOC_SEED_DATA)/.complete $(PHOTO_DATA)/.complete $(IMAGENET_DATA)/.complete $(REAL_DATA)/.complete ## Data-path benchmarks: ratios measured in one run (bench/RESULTS.md has the figures)
	@for b in decode workers real_photos sample_path compose segmentation segmentation_e2e doctor autotune epoch_latency packed hdf5_lmdb shards shard_order shard_memory cache rss photos cpu_profile gpu_prefetch startup examples_main; do $(PY) bench/$$b.py || exit 1; done

soak: setup-dev dataset ## A long run stays flat: PSS, open files, threads per epoch, nothing left after exit (SOAK_EPOCHS=40)
	$(PY) bench/soak.py

# The peers' own venv: they pin numpy, numba, OpenCV and CUDA wheels loadout's lock does not hold. FFCV builds from
# source against Debian's libturbojpeg and OpenCV headers; where that fails the others install and its row says why.
# The stamp waits for all of them, so the next run tries FFCV again.
$(PEERS_VENV)/.installed: bench/peers-requirements.txt
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet -r bench/peers-requirements.txt && touch $@ \
	  || { grep -v '^ffcv' bench/peers-requirements.txt > $(PEERS_VENV)/without-ffcv.txt \
	       && $(PEERS_VENV)/bin/python -m pip install --quiet -r $(PEERS_VENV)/without-ffcv.txt \
	       && echo "FFCV did not install: it builds against libturbojpeg and OpenCV (as root: apt-get install -y" \
	            "libturbojpeg0-dev libopencv-dev pkg-config); its row says so" >&2; }

bench-peers: setup-dev $(PEERS_VENV)/.installed $(REAL_DATA)/.complete ## loadout beside DALI (CPU), FFCV, litdata, mosaicml-streaming, torchvision on real photos (peers in .venv-peers)
	PEERS_PYTHON=$(PEERS_VENV)/bin/python $(PY) bench/peers.py

clean: ## Remove outputs/ (runs and sweeps; keeps .venv and data/)
	rm -rf outputs
