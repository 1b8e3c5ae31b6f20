"""experiments/lm_study_blocks.sh keeps only the blocks whose every head finished by the deadline.

A stand-in for lm_study.py (no training) writes a row per cell as lm_study.py does, in the order
of --seeds, so that the script's process handling and block filter are what is tested.
"""

import csv
import os
import subprocess
import sys
import textwrap

from tests.paths import ROOT

SCRIPT = ROOT / "experiments" / "lm_study_blocks.sh"

STAND_IN = textwrap.dedent(
    """
    import argparse, csv, os, sys, time
    parser = argparse.ArgumentParser()
    parser.add_argument("preset")
    parser.add_argument("--heads")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--ds", type=int, nargs="+")
    parser.add_argument("--out_dir")
    parser.add_argument("--results_csv")
    args = parser.parse_args()
    os.makedirs(args.out_dir)  # each head gets a folder of its own
    for seed in args.seeds:
        for d in args.ds:
            if args.heads == "mos" and seed == 2:
                time.sleep(60)  # the deadline stops this cell
            new = not os.path.exists(args.results_csv)
            with open(args.results_csv, "a", newline="") as f:
                writer = csv.DictWriter(f, ["head", "d", "seed", "test_ppl", "memory"])
                if new:
                    writer.writeheader()
                memory = os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]
                writer.writerow({"head": args.heads, "d": d, "seed": seed,
                                 "test_ppl": 100 + seed, "memory": memory})
    """
)


def test_a_block_the_deadline_cut_short_leaves_no_row(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "lm_study.py").write_text(STAND_IN)
    rows = tmp_path / "rows.csv"
    env = {**os.environ, "PYTHON": sys.executable, "WORK": str(tmp_path / "work")}
    result = subprocess.run(
        ["bash", str(SCRIPT), "3", str(rows), "softmax mos", "smoke", "--seeds", "1", "2",
         "--ds", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    with rows.open(newline="") as f:
        kept = [(r["head"], r["d"], r["seed"], r["memory"]) for r in csv.DictReader(f)]
    # both processes share the accelerator's memory: 0.9 / 2 each
    assert kept == [("softmax", "8", "1", "0.45"), ("mos", "8", "1", "0.45")]
    assert "block d=8 seed=2: left out, unfinished: mos" in result.stdout
    assert "1 whole blocks" in result.stdout


def test_without_arguments_it_prints_its_usage(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2
    assert "lm_study_blocks.sh SECONDS ROWS_CSV" in result.stderr
