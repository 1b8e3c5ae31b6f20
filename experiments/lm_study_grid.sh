#!/usr/bin/env bash
# Runs experiments/lm_study.py's grid in the background from a git worktree pinned at a commit,
# so that later edits of the checkout do not change the code under a running grid, and commits
# each finished cell's row of the results CSV to the checkout as it lands (the grid survives a
# change of machine: rerun this script and the recorded cells are skipped).
#
#   experiments/lm_study_grid.sh COMMIT WORK_DIR RESULTS_CSV [lm_study.py flags ...]
#
# COMMIT: the code to run; WORK_DIR: where the pinned worktree and the cells' run folders go
# (outside the checkout); RESULTS_CSV: a path inside the checkout, committed after each cell.
# With CONSEQUENCES=FILE.json (a path inside the checkout) each finished cell is also measured
# by experiments/consequences.py --merge, and FILE.json, FILE.md (and FILE.png, its plot, once
# there is one) are committed with its row:
# the cells' weights stay outside the checkout, so a change of machine keeps only what was
# committed.
# With REPORT=PAGE (a path inside the checkout without its suffix) and REPORT_FLAGS (lm_study.py's
# flags for that page, as CONTRIBUTING.md gives them), each finished cell also rewrites the page
# from the committed rows with the checkout's code (PAGE.md, PAGE-vs-d.png,
# PAGE-learning-curves.png) and commits it after the row, so that a committed report never
# trails its rows (tests compare the two): e.g. a tuned arm's cells, whose rows the grid's report
# reads.
# Example (PTB's files in DIR):
#   nohup experiments/lm_study_grid.sh HEAD /work/grid docs/results/ptb-transformer.csv \
#       --data_dir DIR --heads softmax sigsoftmax plif > /work/grid/log 2>&1 &
set -euo pipefail
checkout="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$checkout" rev-parse --short=12 "$1")"
work="$(mkdir -p "$2" && cd "$2" && pwd)"
csv="$checkout/$3"
shift 3
code="$work/code-$commit"
[ -d "$code" ] || git -C "$checkout" worktree add --detach "$code" "$commit"
python="${PYTHON:-$checkout/.venv/bin/python}"
# What runs after each finished cell ($CELL and $RESULTS_CSV set by lm_study.py), as a file:
# the row is committed first, so that a measurement cut short never holds it back.
hook="$work/after-cell-$commit.sh"
cat > "$hook" <<END
commit() {  # MESSAGE FILE...: another process may hold git's lock for a moment
  for try in 1 2 3 4 5 6; do
    git -C "$checkout" add -- "\${@:2}" && git -C "$checkout" commit -q -m "\$1" -- "\${@:2}" && return
    sleep 10
  done
}
commit "lm_study (partial grid): \$CELL" "\$RESULTS_CSV"
END
if [ -n "${CONSEQUENCES:-}" ]; then
  out="$checkout/${CONSEQUENCES%.json}"
  cat >> "$hook" <<END
"$python" experiments/consequences.py --merge --out "$out.json" \\
    --run_dirs "$work/runs/cells/\$CELL" &&
  commit "consequences: \$CELL" "$out.json" "$out.md" \$(ls "$out.png" 2>/dev/null)
END
fi
if [ -n "${REPORT:-}" ]; then
  page="$checkout/$REPORT"
  # The checkout's code and venv, not the pinned worktree's (the cell's PYTHONPATH); a fresh
  # folder, as the report's flags (its tuned CSVs) may have changed since the last cell.
  cat >> "$hook" <<END
rm -rf "$work/report" &&
  (cd "$checkout" && env -u PYTHONPATH "$python" experiments/lm_study.py ${REPORT_FLAGS:-} \\
    --report_only --out_dir "$work/report") &&
  cp "$work/report/study.md" "$page.md" &&
  cp "$work/report/test_ppl_vs_d.png" "$page-vs-d.png" &&
  cp "$work/report/learning_curves.png" "$page-learning-curves.png" &&
  commit "$(basename "$REPORT").md: rewritten after \$CELL" "$page.md" "$page-vs-d.png" \\
    "$page-learning-curves.png"
END
fi
cd "$code"
# The pinned worktree's library, not the checkout's editable install; the caller's arguments
# first, where a preset's name must stand.
PYTHONPATH="$code" exec "$python" experiments/lm_study.py "$@" --out_dir "$work/runs" \
    --results_csv "$csv" --after_cell "bash \"$hook\""
