#!/usr/bin/env bash
# The main job: tokenize a bundled MIDI file, decode it back, summarize.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/cadenza
mkdir -p out
prompt=midi_samples/oneills-jig-6-8.mid
$bin inspect "$prompt"
$bin encode "$prompt" > out/demo-tokens.txt
echo "tokens: out/demo-tokens.txt ($(wc -l < out/demo-tokens.txt) tokens)"
$bin decode out/demo-tokens.txt -o out/demo-roundtrip.mid
