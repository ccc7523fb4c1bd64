# The two commands a newcomer needs: `make demo` and `make test`.
# Each installs what it lacks (libtorch into .venv, a General MIDI SoundFont).

CARGO ?= cargo
SHELL := /bin/bash

.PHONY: demo test setup corpus-test bench fmt

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) test --workspace

# Tests over the whole shared corpus (../shared/corpus or $$CADENZA_CORPUS):
# tokenizer round trips and the shipped model's validation loss.
corpus-test: setup
	$(CARGO) test --test corpus --test shipped -- --ignored --nocapture

bench: setup
	$(CARGO) bench

fmt:
	$(CARGO) fmt --all
