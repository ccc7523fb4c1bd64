#!/usr/bin/env bash
# Issue 25's side-by-side fine-tunes (docs/form.md of the project): every row starts from
# the shipped model's weights and trains STEPS steps on the same batches (seed 0; the
# batches depend on (seed, step) and the window length only), with the same tokens per
# step (8 x 512 or 2 x 2048). A row already finished is skipped; one interrupted is
# resumed exactly (--resume). Usage: bash scripts/form-experiments.sh [ROW ...]
# Rows: base512 music512 base2048 music2048 (default: these, in that order), and
# starts512 bars512 (the bar embedding and its control; run with STEPS=600), and
# barsknown512 (the bar embedding with every window's bar index known, window_bars);
# from the musical-RoPE model shipped on 2026-12-04: ship2048 (its configuration, 2 x
# 2,048) and onepiece2048 (the same with every window whole inside one long piece);
# starts2048 (half the windows from a piece's start) and reprise2048 (the same on the
# corpus plus REPRISE made-up pieces in which a training tune comes back ~1,000 tokens
# later, scripts/form/recall-probe.py --training-pieces; data in $OUT/recall);
# openings2048 (starts2048 with the pieces entered at their BOS drawn per piece, not in
# proportion to length: scripts/shipped-stage2.toml, stage 2 of the model shipped 2026-12-06).
# INIT: the weights every row starts from (default models/cadenza-small; the rows of
# 2026-12-04/05 started from stage 1, the model shipped on 2026-12-04: INIT=runs/stage1-model
# after scripts/train-shipped-stage2.sh has written it from git).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/form/train-row.sh
BIN=${BIN:-target/release/cadenza}
DATA=${DATA:-runs/corpus-data-remi-compact}
OUT=${OUT:-runs/form}
STEPS=${STEPS:-150}
REPRISE=${REPRISE:-1500}
INIT=${INIT:-models/cadenza-small}
LR=${LR:-3e-4}
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(music512 base512 music2048 base2048)
mkdir -p "$OUT"
# a fresh machine has no tokenized corpus: make it as train-shipped.sh does (2 s)
if [ ! -f "$DATA/manifest.json" ]; then
    corpus=${CADENZA_CORPUS:-../shared/corpus}
    "$BIN" tokenize "$corpus/classical" "$corpus/folk" --vocab vocab/remi-compact.json -o "$DATA"
fi
for row in "${rows[@]}"; do
    data=$DATA
    case $row in
        base512) cfg=scripts/form/base.toml; shape=(--seq-len 512 --batch 8) ;;
        music512) cfg=scripts/form/music.toml; shape=(--seq-len 512 --batch 8) ;;
        base2048) cfg=scripts/form/base.toml; shape=(--seq-len 2048 --batch 2) ;;
        music2048) cfg=scripts/form/music.toml; shape=(--seq-len 2048 --batch 2) ;;
        starts512) cfg=scripts/form/starts.toml; shape=(--seq-len 512 --batch 8) ;;
        bars512) cfg=scripts/form/bars.toml; shape=(--seq-len 512 --batch 8) ;;
        barsknown512) cfg=scripts/form/barsknown.toml; shape=(--seq-len 512 --batch 8) ;;
        ship2048) cfg=scripts/form/ship.toml; shape=(--seq-len 2048 --batch 2) ;;
        onepiece2048) cfg=scripts/form/onepiece.toml; shape=(--seq-len 2048 --batch 2) ;;
        starts2048) cfg=scripts/form/starts2048.toml; shape=(--seq-len 2048 --batch 2) ;;
        openings2048) cfg=scripts/shipped-stage2.toml; shape=(--seq-len 2048 --batch 2) ;;
        reprise2048) cfg=scripts/form/starts2048.toml; shape=(--seq-len 2048 --batch 2)
            data=$OUT/recall/train
            [ -f "$data/manifest.json" ] ||
                python3 scripts/form/recall-probe.py "$DATA" "$OUT/recall" --training-pieces "$REPRISE" ;;
        *) echo "unknown row $row" >&2; exit 2 ;;
    esac
    run=$OUT/$row
    train_row "$row, from $INIT" "$run" "$STEPS" \
        "$BIN" train -o "$run" --data "$data" --vocab vocab/remi-compact.json \
        --init "$INIT" --config "$cfg" "${shape[@]}" \
        --steps "$STEPS" --lr "$LR"
done
