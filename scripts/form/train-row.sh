# Sourced by scripts/form-experiments.sh and scripts/form-scratch.sh.
# train_row NAME RUN STEPS COMMAND...: a run whose checkpoint is at STEPS is done and
# skipped; one with an earlier checkpoint is resumed exactly (train --resume); a new
# one runs COMMAND. Needs BIN (the cadenza binary).
train_row() {
    local name=$1 run=$2 steps=$3
    shift 3
    local state=$run/checkpoint/state.json
    if [ -f "$state" ] && grep -Eq "\"step\": *$steps\b" "$state"; then
        echo "== $name: done"
    elif [ -f "$state" ]; then
        echo "== $name: resuming"
        "$BIN" train -o "$run" --resume
    else
        echo "== $name: $steps steps"
        "$@"
    fi
}
