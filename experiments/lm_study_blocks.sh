#!/usr/bin/env bash
# Trains whole blocks (one d and seed: a head and the softmax it is compared with) of
# experiments/lm_study.py's grid on one machine, one process per head at once (a GPU has room for
# them all), and writes to ROWS_CSV the rows of the blocks whose every head finished before the
# deadline. A block cut short leaves no row, so that its cells can all train on another device:
# no compared pair crosses devices. Run it from a checkout at the grid's commit (each row
# records the commit it ran from), then merge ROWS_CSV into the grid's CSV (docs/lm_study.md).
#
#   bash PATH/TO/experiments/lm_study_blocks.sh SECONDS ROWS_CSV "HEADS" [lm_study.py flags ...]
#
# e.g. on a lent GPU, the fixed-trunk grid's seed 3 at d = 128 and 64:
#   XLA_FLAGS=--xla_gpu_autotune_level=0 bash experiments/lm_study_blocks.sh 540 $OUT/rows.csv \
#       "softmax sigsoftmax plif mos mixtape" --embedding fixed \
#       --trunk.head.shared_gate_below 100 --seeds 3 --ds 128 64 \
#       --trunk.head.memory_budget_mib 2048 --rank_d None --data_dir PTB_DIR
# Each process trains its head's cells in the order of --seeds and --ds; all share a persistent
# compilation cache (JAX_COMPILATION_CACHE_DIR, default WORK/jax-cache), so a head's second
# cell at a d it has trained loads its programs instead of compiling them again (JAX caches the
# programs that took over a second to compile: the heads' own, not the small ones they share).
# WORK (default: a new temporary folder) holds the cells' run folders, their logs and the cache.
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '9p' "$0" | sed 's/^# *//' >&2
  exit 2
fi
seconds=$1 rows=$2 heads=$3
shift 3
work="${WORK:-$(mktemp -d)}"
mkdir -p "$work"
python="${PYTHON:-python}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$work/jax-cache}"
# The processes share the accelerator's memory (JAX takes 75% of it by default, per process).
count=$(wc -w <<<"$heads")
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(
  awk -v n="$count" 'BEGIN { printf "%.2f", 0.9 / n }')}"
for head in $heads; do
  # The caller's arguments first, where a preset's name must stand.
  timeout --signal=INT "$seconds" "$python" experiments/lm_study.py "$@" --heads "$head" \
      --out_dir "$work/$head" --results_csv "$work/rows-$head.csv" > "$work/$head.log" 2>&1 &
done
wait || true  # a cell the deadline stopped exits non-zero; its block is left out below
# Self-contained: it runs beside the pinned commit's library, which may not have today's
# bottleneck.runs.lm_study (read_results_csv, merge_results_csv).
"$python" - "$rows" "$work" $heads <<'PY'
import csv
import sys
from pathlib import Path

out, work, heads = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
finished = {}  # (d, seed) -> {head: row}
fields = []
for head in heads:
    path = work / f"rows-{head}.csv"
    if not path.exists():
        continue
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields += [name for name in reader.fieldnames or () if name not in fields]
        for row in reader:
            if row.get("test_ppl"):
                finished.setdefault((int(row["d"]), int(row["seed"])), {})[row["head"]] = row
whole = 0
with out.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    for (d, seed), cells in sorted(finished.items()):
        missing = " ".join(h for h in heads if h not in cells)
        if missing:
            print(f"block d={d} seed={seed}: left out, unfinished: {missing}")
        else:
            writer.writerows(cells[head] for head in heads)
            print(f"block d={d} seed={seed}: {len(heads)} rows")
            whole += 1
print(f"{whole} whole blocks in {out}")
PY
