"""Perplexity against the bottleneck width d for every head, trained to the study's stopping
rule: a multi-seed study.

The seeds' central claim (Yang et al. 2018; Kanai et al. 2018; Ganea et al. 2019): a softmax over
``W h`` with ``h`` in R^d gives log-probability matrices of rank <= d + 1, so a head that breaks
the bottleneck (sigsoftmax, PLIF, MoS, Mixtape, ...) should lower perplexity, and most where d is
small. This script trains one language model per cell of the grid ``heads x ds x seeds`` with the
language model's own run loop (``experiments/language_model.py``, in-process) and tabulates it.

Model (a Transformer, by default). Every cell is ``--trunk``, a config of ``language_model.py``
(by default its preset ``transformer-study``: 2 pre-norm layers of width 128, AdamW with warmup
and a cosine over the budget; its flags, such as ``--data_dir`` or ``--epochs``, set every
cell's), with the cell's head, ``head_features d``, seed and folders replaced. The head reads
``h = P x`` (a learned ``128 -> d`` projection of the trunk's features), so a softmax head's
log-probabilities have rank <= d + 2 (with its output bias) whatever the trunk. The trunk is
not fixed across d: the tied embedding is factorized (ALBERT), a ``d``-wide table shared with
the head's decoder, projected up to the trunk's width at the input, so d sizes the input
embedding too (softmax's parameters go from 0.57 M at d = 16 to 1.72 M at d = 128). Mixtures
decode ``K`` latents of width ``d`` with the same tied table.
``--embedding fixed`` keeps everything but the head the same at every ``d`` instead: a
``d_model``-wide tied table ``E`` (the unfactorized model's embedding) decoded by the head as
``E Q`` with a learned ``[d_model, d]`` map ``Q`` (``--embedding_features`` of
``language_model.py``; its digests differ from the factorized grid's, so the two never mix in
one results CSV).
The presets ``awd-*`` are the earlier study: a 2-layer AWD-LSTM of inner width ``--nhid`` whose
last layer, tied embedding and head input have width ``d`` (``awd-2epoch`` is the grid of
docs/lm_study.md).

Data. PTB with all its 10,000 words by default (``--vocab_size N`` keeps the N most frequent
training words, the rest ``<unk>``). The preset ``control`` is the negative control: 64 words at
d = 64, where no head has a rank bottleneck.

Protocol (the same for every head). Every cell of a seed sees the same data order, window lengths
and dropout stream (functions of the seed); each trains until validation perplexity has not
improved for ``--patience`` epochs or until the ``--epochs`` budget ends: ``stop_reason`` says
which, and ``converged`` is true when early stopping ended the cell or its last three epochs
improved validation by less than 0.5% in all (the study's stopping rule: a cell it calls
converged may still improve a little each epoch, not a converged model). The best-validation model is evaluated. No head is
tuned on its own.

    python experiments/lm_study.py smoke --out_dir /tmp/study  # seconds, fixtures
    python experiments/lm_study.py             # the default grid (PTB downloaded; --data_dir DIR)
    python experiments/lm_study.py control                     # the negative control
    python experiments/lm_study.py awd-2epoch                  # the AWD-LSTM grid

Resumable. Every cell is a language-model run folder under ``OUT_DIR/cells/`` with its own
checkpoints: rerunning the command skips finished cells and resumes an unfinished one where it
stopped (Ctrl-C saves and exits). With ``--results_csv FILE`` each finished cell's row is merged
into FILE at once, and a cell whose row there has the same config (``config_sha``) is not run
again, even on another machine without its folder; ``experiments/lm_study_grid.sh`` runs a grid
in the background from a worktree pinned at a commit and commits each row as it lands. A cell
that fails (say, diverges) is recorded with its error and the grid goes on; rerunning retries it.
Every cell of a block (one ``d`` and seed: the cells the report compares) trains on one device
and CPU model, from one commit of the code, which its row records: where another device or
another commit finished cells of a block, its other cells are left pending for a machine and
code like theirs, and the grid goes on with the other blocks; a cell begun elsewhere or at
another commit but not finished is set aside (``NAME.set-aside-N``) and trained afresh, so that
no checkpoint resumes on another device or code.

Writes to --out_dir: config.json; study.json / study.csv (one row per cell: valid / test
perplexity, epochs, stopping reason, convergence, seconds, parameters, the validation curve, the
code's commit), study.md (mean +- std per head x d and the gain over softmax, seed by seed),
test_ppl_vs_d.png (perplexity and the gain over softmax against d), the gains' paired 95%
intervals, paired t p-values and Holm's correction over the grid, the design's power, each
head's trend with d and the pairs that cross devices (in study.md), learning_curves.png, and
for ``--rank_d`` the numerical / effective rank of each head's test log-probabilities
(``rank/<head>/``, as ``experiments/rank.py --mode model`` writes them; ``ranks`` in study.json).
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bottleneck.runs import (
    RunDir,
    RunFolderError,
    UsageError,
    code_commit,
    language_model,
    open_run,
    parse_config,
)
from bottleneck.runs.cli import one_line_errors
from bottleneck.runs.folder import accelerator, check_resumable
from bottleneck.runs.lm_study import (
    PRESETS,
    Config,
    cell_config,
    cell_name,
    cell_row,
    config_sha,
    curve_from_row,
    learning_curve,
    merge_results_csv,
    read_results_csv,
)
from bottleneck.runs.lm_study_report import write_report
from bottleneck.runs.log_prob_spectrum import SpectrumOptions, write_log_prob_spectrum
from bottleneck.runs.run_loop import TrainingDiverged

# ----------------------------------------------------------------------------------------------


def finished_results(cell: language_model.Config) -> dict[str, Any] | None:
    """The cell's results if it finished with this config, up to the fields that change only
    how it computes (else it must run or resume: a resumed run checks its data again)."""
    root = Path(cell.out_dir)
    if not (root / "results.json").is_file() or not (root / "config.json").is_file():
        return None
    try:
        check_resumable(root, cell, may_change=language_model.COMPUTE_ONLY)
    except RunFolderError:
        return None  # e.g. a longer --epochs budget: the cell resumes from its checkpoint
    return json.loads((root / "results.json").read_text())


# A cell's folder names the device it trains on in this file, written before its first step:
# a checkpoint resumed elsewhere would mix two devices' arithmetic in one cell.
DEVICE_FILE = "device.txt"


def mark_device(cell: language_model.Config, device: str) -> None:
    path = Path(cell.out_dir) / DEVICE_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(device + "\n")


def block_origins(
    config: Config, recorded: dict[tuple[str, int, int, str], dict[str, Any]], d: int, seed: int
) -> set[str]:
    """Where, and from which code, the cells of the block ``(d, seed)`` trained to the end
    (:func:`origin`): their rows in ``recorded``, and their finished folders.

    The report compares each head with softmax at one ``d`` and seed, so a block's cells train
    on one device (and CPU model) from one commit of the code: a cell whose block finished
    cells elsewhere, or at another commit, waits, pending, for a machine and code like theirs,
    and the grid goes on with the other blocks (a grid pinned at a new commit takes whole new
    blocks, not the ends of old ones).
    """
    origins = set()
    for head in config.heads:
        cell = cell_config(config, head, d, seed)
        row = recorded.get((head, d, seed, config_sha(cell)))
        if row is not None and row.get("device"):
            origins.add(origin(row["device"], row.get("commit")))
        began = cell_origin(cell)
        if began and (Path(cell.out_dir) / "results.json").is_file():
            origins.add(began)
    return origins


def origin(device: str, commit: str | None) -> str:
    return f"{device} at commit {commit or 'unrecorded'}"


def cell_origin(cell: language_model.Config) -> str | None:
    """Where a cell's folder began training (:data:`DEVICE_FILE`) and from which code (the
    commit its ``config.json`` records: a cell resumes only from the code it began with); None
    if it names no device. A folder that recorded no config yet trained nothing, and is taken
    as this code's."""
    root = Path(cell.out_dir)
    if not (root / DEVICE_FILE).is_file():
        return None
    record = root / "config.json"
    commit = json.loads(record.read_text()).get("commit") if record.is_file() else code_commit()
    return origin((root / DEVICE_FILE).read_text().strip(), commit)


def set_aside(cell: language_model.Config) -> Path:
    """Moves a cell's unfinished folder out of the grid's way (``NAME.set-aside-N``)."""
    root = Path(cell.out_dir)
    n = 1
    while root.with_name(f"{root.name}.set-aside-{n}").exists():
        n += 1
    return root.rename(root.with_name(f"{root.name}.set-aside-{n}"))


def run_cell(cell: language_model.Config) -> dict[str, Any]:
    """Trains (or resumes) one cell; a finished cell is read back, a failure is recorded."""
    results = finished_results(cell)
    if results is not None:
        return {"status": "done", **results}
    try:
        results = language_model.run_experiment(cell)
    except (UsageError, TrainingDiverged) as err:
        print(f"cell {Path(cell.out_dir).name} failed: {err}", file=sys.stderr)
        return {"status": "failed", "error": str(err)}
    return {"status": "done", **results}


def rank_cells(config: Config, run: RunDir) -> list[dict[str, Any]]:
    """Numerical and effective rank of each head's test log-probs at ``rank_d`` (Kanai Table 3)."""
    ranks = []
    for head in config.heads:
        cell = cell_config(config, head, config.rank_d, config.seeds[0])
        log_probs = Path(cell.out_dir) / "log_probs"
        if not log_probs.is_dir():
            continue
        options = SpectrumOptions(
            hidden_size=config.rank_d, max_vocab=config.rank_vocab, max_tokens=config.rank_tokens
        )
        row = write_log_prob_spectrum(str(log_probs), RunDir(run.root / "rank" / head), options)
        ranks.append({"head": head, "d": config.rank_d, **row})
    return ranks


def run_hook(command: str, name: str, results_csv: Path | None) -> None:
    """``--after_cell``'s command for the cell ``name``, with $CELL and $RESULTS_CSV set."""
    env = {**os.environ, "CELL": name, "RESULTS_CSV": str(results_csv or "")}
    subprocess.run(command, shell=True, env=env, check=False)


def check_report_inputs(config: Config) -> None:
    """The CSVs that only the report reads must exist: a misspelt path would otherwise read as
    an arm with no cell recorded yet (or, for --report_only, a grid with none)."""
    named = [("--tuned_csvs", path) for path in config.tuned_csvs]
    named += [("--probe_csv", config.probe_csv)] if config.probe_csv is not None else []
    named += [("--results_csv", config.results_csv)] if config.report_only else []
    for flag, path in named:
        if not Path(path).is_file():
            raise UsageError(f"{flag} {path}: no such file")


def run_study(config: Config) -> dict[str, Any]:
    check_report_inputs(config)
    root = Path(config.out_dir)
    run = open_run(root, config, resume=True)
    start = time.perf_counter()
    rows, curves = [], {}
    results_csv = None if config.results_csv is None else Path(config.results_csv)
    recorded = {} if results_csv is None else read_results_csv(results_csv)
    cells = [(h, d, s) for s in config.seeds for d in config.ds for h in config.heads]
    device = accelerator()
    here = origin(device, code_commit())
    for i, (head, d, seed) in enumerate(cells):
        cell = cell_config(config, head, d, seed)
        name = cell_name(head, d, seed)
        key = (head, d, seed, config_sha(cell))
        finished_before = finished_results(cell) is not None
        if key in recorded and not finished_before:
            print(f"=== cell {i + 1}/{len(cells)}: {name}: recorded in {results_csv} ===")
            curves[(head, d, seed)] = curve_from_row(recorded[key])
            rows.append(recorded[key])
            continue
        if config.report_only and not finished_before:
            rows.append({"head": head, "d": d, "seed": seed, "status": "pending"})
            continue
        others = block_origins(config, recorded, d, seed) - {here}
        if others and not finished_before:
            print(
                f"=== cell {i + 1}/{len(cells)}: {name}: deferred: its block (d = {d}, seed "
                f"{seed}) trained on {', '.join(sorted(others))}, this is {here} ==="
            )
            rows.append({"head": head, "d": d, "seed": seed, "status": "pending"})
            continue
        print(f"\n=== cell {i + 1}/{len(cells)}: {name} ===", flush=True)
        began = cell_origin(cell)
        if began not in (None, here):  # nothing of it is recorded: train it afresh here
            print(f"its checkpoint began on {began}: set aside in {set_aside(cell)}")
        mark_device(cell, device)
        results = run_cell(cell)
        curves[(head, d, seed)] = learning_curve(cell)
        row = cell_row(config, cell, results, curves[(head, d, seed)])
        rows.append(row)
        if row["status"] != "done":
            continue
        # The hook runs for what this invocation finished or recorded, not on every rerun.
        landed = not finished_before
        if results_csv is not None and key not in recorded:
            merge_results_csv(results_csv, row)
            recorded[key] = row
            landed = True
        if landed and config.after_cell:
            run_hook(config.after_cell, name, results_csv)
    return finish_study(config, run, rows, curves, start)


def finish_study(
    config: Config, run: RunDir, rows: list[dict[str, Any]], curves: dict, start: float
) -> dict[str, Any]:
    """The grid's ranks (where ``rank_d`` is set) and report, written to the study's folder."""
    ranks = rank_cells(config, run) if config.rank_d is not None else []
    study = write_report(run, config, rows, curves, ranks)
    study["seconds_this_invocation"] = time.perf_counter() - start
    run.write_json("study.json", study)
    failed = sum(r["status"] == "failed" for r in rows)
    print(
        f"\nwrote {Path(config.out_dir)}/: study.json, study.csv, study.md, test_ppl_vs_d.png, "
        f"learning_curves.png{', rank/' if ranks else ''}"
        + (f"\n{failed} cell(s) failed; rerun the same command to retry them" if failed else "")
    )
    return study


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_config(Config, PRESETS, argv)
    with one_line_errors(config):
        study = run_study(config)
    if any(r["status"] == "failed" for r in study["cells"]):
        raise SystemExit(1)
    return study


if __name__ == "__main__":
    main(sys.argv[1:])
