# The two commands a newcomer needs: `make demo` and `make test`.
# Each installs what it lacks (libtorch into .venv, a General MIDI SoundFont).

CARGO ?= cargo
SHELL := /bin/bash

.PHONY: demo test setup corpus-test bench fmt browser-test studio-screenshot distributed-test bench-distributed

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) test --workspace

# Tests over the whole shared corpus (../shared/corpus or $$CADENZA_CORPUS):
# tokenizer round trips (tokens, then through a MIDI file: >= 99.95% of notes back)
# and the shipped model's validation loss.
corpus-test: setup
	$(CARGO) test --test corpus --test shipped -- --ignored --nocapture
	$(CARGO) test -p cadenza-core --release --test corpus_roundtrip -- --ignored --nocapture

# The studio (`cadenza serve`) in headless Chromium over WebDriver; installs
# Debian's chromium and chromium-driver when root and missing. `make test`
# runs the same test but skips it where they are missing; here it must run.
browser-test: setup
	@bash scripts/setup-browser.sh
	CADENZA_REQUIRE_BROWSER=1 $(CARGO) test --test browser -- --nocapture

# docs/studio.png: the page with a piece from the shipped model.
studio-screenshot: setup
	@bash scripts/setup-browser.sh
	CADENZA_REQUIRE_BROWSER=1 CADENZA_STUDIO_MODEL=models/cadenza-small \
	  CADENZA_STUDIO_SCREENSHOT=docs/studio.png $(CARGO) test --test browser -- --nocapture

# Data-parallel training over MPI on localhost (2 ranks of the tiny preset): installs
# Open MPI and libclang when root and missing, builds with --features distributed.
# As root, Open MPI needs OMPI_ALLOW_RUN_AS_ROOT (the test sets it for its mpirun).
distributed-test: setup
	@bash scripts/setup-mpi.sh
	$(CARGO) clippy --features distributed --all-targets -- -D warnings
	$(CARGO) test --features distributed --test distributed -- --test-threads 2
	$(CARGO) test --features distributed --lib train::distributed

# 2 ranks x 1 thread against 1 process x 2 threads (docs/distributed.md).
bench-distributed: setup
	@bash scripts/setup-mpi.sh
	@bash scripts/bench-distributed.sh

bench: setup
	$(CARGO) bench

fmt:
	$(CARGO) fmt --all
