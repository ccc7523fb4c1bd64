#!/usr/bin/env bash
# Generation next to a busy neighbour: the shipped model generates 2,048
# tokens at batch 1, alone, then while another process trains a model with 2
# libtorch threads (benches/train_speed.rs, whose OpenMP threads spin on both
# cores), then alone again. Prints tokens/s of each run and the slowdown.
# Give it the machine otherwise alone.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q
cargo bench -q --bench train_speed --no-run 2>/dev/null
gen() {
  target/release/cadenza generate --model models/cadenza-small --tokens 2048 --seed 1 \
    -o "$(mktemp -d)/g.mid" 2>&1 | grep -o '[0-9]* tokens/s' | cut -d' ' -f1
}
alone1=$(gen)
cargo bench -q --bench train_speed -- --len 512 --batch 8 --steps 400 --threads 2 >/dev/null 2>&1 &
busy=$!
sleep 5
shared=$(gen)
# `cargo bench` does not pass its signal on to the bench binary: stop both.
pkill -f "train_speed-.* --steps 400" 2>/dev/null || true
kill $busy 2>/dev/null; wait $busy 2>/dev/null || true
while pgrep -f "train_speed-.* --steps 400" >/dev/null; do sleep 0.5; done
sleep 2
alone2=$(gen)
python3 - "$alone1" "$shared" "$alone2" <<'PY'
import sys
a1, s, a2 = map(float, sys.argv[1:])
a = (a1 + a2) / 2
print("| run | tokens/s |\n|---|---:|")
print(f"| alone (before) | {a1:,.0f} |\n| next to a 2-thread training | {s:,.0f} |\n| alone (after) | {a2:,.0f} |")
print(f"\nslowdown next to the neighbour: {a / s:.2f}x (mean of the two runs alone / shared)")
PY
