#!/usr/bin/env bash
# Decoding and averaging levers of a finished Multi30k run, scored on val only (never on test):
# how many last checkpoints to average, beam 1 vs 5, length penalty 0.6 vs 1.0, the best single
# checkpoint. One line per setting: its name, then evaluate's JSON.
#   bash benchmarks/multi30k_levers.sh RUN_DIR [OUT_DIR] [TGT_LANG] [MULTI30K_DIR]
# RUN_DIR is the run's training directory (the one holding checkpoints/ and best/), and the run
# must have kept at least 20 checkpoints (train.keep_last).
set -euo pipefail
run=${1:?usage: multi30k_levers.sh RUN_DIR [OUT_DIR] [TGT_LANG] [MULTI30K_DIR]}
out=${2:-runs/levers}
tgt=${3:-de}
data=${4:-../shared/data/multi30k}
val=(--src "$data/tok/val.lc.norm.tok.en.gz" --ref "$data/tok/val.lc.norm.tok.$tgt.gz")
mkdir -p "$out"
for n in 5 10 20; do
  atencion average --force --out "$out/avg$n" $(ls -d "$run"/checkpoints/step_* | tail -"$n") > /dev/null
  echo "avg$n beam5 alpha0.6 $(atencion evaluate --model "$out/avg$n" --beam 5 "${val[@]}")"
done
echo "avg10 beam1 $(atencion evaluate --model "$out/avg10" --beam 1 "${val[@]}")"
echo "avg10 beam5 alpha1.0 $(atencion evaluate --model "$out/avg10" --beam 5 --alpha 1.0 "${val[@]}")"
echo "best beam5 alpha0.6 $(atencion evaluate --model "$run/best" --beam 5 "${val[@]}")"
