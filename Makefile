# streamrec — set-up, checks and tests. Every target is idempotent: `make test`
# on an up-to-date checkout skips the install and goes straight to the checks.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is installed first and pinned so that pip resolves the CPU wheel and the
# rest of the dependencies see it satisfied (an unpinned torch pulls CUDA wheels).
TORCH_SPEC ?= torch==2.13.0
# The peers benchmarks/e2e.py measures against: TorchRec on FBGEMM's CPU kernels. They are
# installed without their declared dependencies (torchrec asks for the CUDA fbgemm-gpu);
# the `peers` extra holds the ones they do need. The 1.9 releases fail to load on torch 2.13.
PEERS_SPEC ?= torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
# Two test processes, each taking whole files (a file's tests share its fixtures and
# run in order): most tests wait on real processes, so two cores run two files at
# once (9.5 minutes instead of 15). `make test PYTEST_ARGS=` runs them one by one.
# Files go out in collection order (`--no-loadscope-reorder`): xdist's own order
# (most tests first) and longest first both put the heavy files side by side.
# The 30 slowest are listed at the end: the suite has a 25-minute budget on 2 cores.
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=30
DEMO_ARGS ?=

.PHONY: install browser lint typecheck proto proto-check docs test test-only test-fast demo s3 bench-store bench-pipeline bench-e2e bench-chaos bench-scale bench-tiers bench-quality bench-serve bench-soak clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test,dev,peers,docs]"
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps $(PEERS_SPEC)
	touch $(STAMP)

# The dashboard tests drive Debian's Chromium headless; installed once (needs root,
# as in CI), skipped when both programs are already there.
BROWSER_PKGS := chromium chromium-driver
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  apt-get install -y -q --no-install-recommends $(BROWSER_PKGS) || \
	  { apt-get update -q && apt-get install -y -q --no-install-recommends $(BROWSER_PKGS); }; }

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

proto: install
	$(BIN)/python -m embedding_store.proto.generate

proto-check: install
	$(BIN)/python -m embedding_store.proto.generate --check

# The docs site (MkDocs + Material) into site/. --strict fails on a broken link, a
# missing page or anchor, and the generated reference pages import the packages, so
# a schema or parser that no longer renders fails here too. Not -q: it hides the
# warnings that --strict counts, and a broken link then passes.
# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2, noise in every build.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs
docs: install
	$(MKDOCS) build --strict

# mypy (about 40 s of one core) checks beside the suite rather than before it: the
# suite's tests wait on real processes and leave a core idle about a quarter of the
# time. Either failing fails the target.
test: install browser proto-check
	$(BIN)/ruff check .
	$(MKDOCS) build --strict
	$(BIN)/mypy & mypy=$$!; $(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  wait $$mypy || rc=1; exit $$rc

test-only:
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The fast tier, for the edit-test loop: ruff, then every test not marked `processes`
# (those start brokers, store shards, jobs, Dask clusters, browsers, S3 or rank
# processes), test by test on two cores. A test that starts a process in this run
# without the marker fails and says to mark it (tests/conftest.py). `make test` still
# runs everything.
FAST_ARGS ?= -n 2 -m "not processes"
test-fast: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(FAST_ARGS)

# The embedded default: local Dask cluster, two store shards, the synthetic stream.
demo: install
	$(BIN)/streamrec demo $(DEMO_ARGS)

# A local S3-compatible object store (SeaweedFS) for trying cluster mode; prints its
# URL and key. `$(BIN)/streamrec s3 down` stops it.
s3: install
	$(BIN)/streamrec s3 up

bench-pipeline: install
	$(BIN)/python benchmarks/pipeline.py --json bench-results/pipeline.json

bench-e2e: install
	$(BIN)/python benchmarks/e2e.py --json bench-results/e2e.json

bench-chaos: install
	$(BIN)/python benchmarks/chaos.py --json bench-results/chaos.json

bench-scale: install
	$(BIN)/python benchmarks/scale.py --json bench-results/scale.json

# A table larger than memory: the disk, the tier's engine, hit rates and rates against memory.
bench-tiers: install
	$(BIN)/python benchmarks/tiers.py --json bench-results/tiers.json

bench-store: install
	$(BIN)/python benchmarks/store.py --json bench-results/store.json

bench-quality: install
	$(BIN)/python benchmarks/quality.py --json bench-results/quality.json

bench-serve: install
	$(BIN)/python benchmarks/serve.py --json bench-results/serve.json

# An hour at 70% of the job's capacity: memory, lag, disk and speed must stay flat.
bench-soak: install
	$(BIN)/python benchmarks/soak.py --minutes 60 --json bench-results/soak.json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
