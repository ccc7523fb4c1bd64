#!/usr/bin/env bash
# The main job: continue a bundled prompt with the shipped model into a
# 3,072-token piece, written as MIDI, WAV and a piano-roll PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/cadenza
model=${MODEL:-models/cadenza-small}
prompt=${PROMPT:-midi_samples/oneills-jig-6-8.mid}
mkdir -p out
$bin generate --model "$model" --prompt "$prompt" --prompt-bars 8 \
  --tokens 3072 --min-tokens 3072 --temperature 1.0 --top-p 0.95 --seed "${SEED:-1}" \
  -o out/demo.mid --wav out/demo.wav --png out/demo.png --tokens-out out/demo-tokens.txt
echo
echo "Listen to out/demo.wav, open out/demo.mid in any DAW, or look at out/demo.png."
