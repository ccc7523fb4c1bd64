#!/usr/bin/env bash
# Generation next to a busy neighbour: the shipped model generates 2,048
# tokens at batch 1, alone, then while another process trains a model with 2
# libtorch threads (benches/train_speed.rs, whose OpenMP threads spin on both
# cores), then alone again. Prints tokens/s of each run and the slowdown.
# Give it the machine otherwise alone.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q
# The neighbour is the built bench binary itself, started directly: through
# `cargo bench`, a stale build would make the neighbour a compile, and killing
# cargo would leave its rustc running into the last measurement.
neighbour=$(cargo bench -q --bench train_speed --no-run --message-format=json 2>/dev/null |
  python3 -c "import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m.get('executable') and m['target']['name'] == 'train_speed':
        print(m['executable'])")
[ -x "$neighbour" ] || { echo "could not build benches/train_speed.rs" >&2; exit 1; }
gen() {
  target/release/cadenza generate --model models/cadenza-small --tokens 2048 --seed 1 \
    -o "$(mktemp -d)/g.mid" 2>&1 | grep -o '[0-9]* tokens/s' | cut -d' ' -f1
}
alone1=$(gen)
"$neighbour" --bench --len 512 --batch 8 --steps 400 --threads 2 >/dev/null 2>&1 &
busy=$!
sleep 5
shared=$(gen)
kill $busy 2>/dev/null; wait $busy 2>/dev/null || true
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
