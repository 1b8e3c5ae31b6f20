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

    python experiments/lm_study.py --preset smoke --out_dir /tmp/study    # seconds, fixtures
    python experiments/lm_study.py             # the default grid (PTB downloaded; --data_dir DIR)
    python experiments/lm_study.py --preset control                       # the negative control
    python experiments/lm_study.py --preset awd-2epoch                    # the AWD-LSTM grid

Resumable. Every cell is a language-model run folder under ``OUT_DIR/cells/`` with its own
checkpoints: rerunning the command skips finished cells and resumes an unfinished one where it
stopped (Ctrl-C saves and exits). With ``--results_csv FILE`` each finished cell's row is merged
into FILE at once, and a cell whose row there has the same config (``config_sha``) is not run
again, even on another machine without its folder; ``experiments/lm_study_grid.sh`` runs a grid
in the background from a worktree pinned at a commit and commits each row as it lands. A cell
that fails (say, diverges) is recorded with its error and the grid goes on; rerunning retries it.
Every cell of a block (one ``d`` and seed: the cells the report compares) trains on one device
and CPU model, which its row records: where another device finished cells of a block, its other
cells are left pending for a machine like it, and the grid goes on with the other blocks; a
cell another device began but did not finish is set aside (``NAME.set-aside-N``) and trained
afresh, so that no checkpoint resumes on another device.

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
import csv
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from scipy import optimize, stats

from bottleneck.runs import (
    RunDir,
    RunFolderError,
    UsageError,
    language_model,
    markdown_table,
    open_run,
    parse_config,
)
from bottleneck.runs.cli import one_line_errors
from bottleneck.runs.folder import accelerator, check_resumable, code_commit, to_jsonable
from bottleneck.runs.language_model import AWDLSTMConfig, TransformerConfig
from bottleneck.runs.lm_study import PRESETS, Config, cell_config, cell_name
from bottleneck.runs.log_prob_spectrum import SpectrumOptions, write_log_prob_spectrum
from bottleneck.train.run_loop import TrainingDiverged

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FormatStrFormatter  # noqa: E402

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


def block_devices(
    config: Config, recorded: dict[tuple[str, int, int, str], dict[str, Any]], d: int, seed: int
) -> set[str]:
    """The devices that trained cells of the block ``(d, seed)`` to the end: their rows in
    ``recorded`` and their finished folders' :data:`DEVICE_FILE`.

    The report compares each head with softmax at one ``d`` and seed, so a block's cells train
    on one device (and CPU model): a cell whose block another device has finished cells of waits,
    pending, for a machine of that device, and the grid goes on with the other blocks.
    """
    devices = set()
    for head in config.heads:
        cell = cell_config(config, head, d, seed)
        row = recorded.get((head, d, seed, config_sha(cell)))
        if row is not None and row.get("device"):
            devices.add(row["device"])
        began = cell_device(cell)
        if began and (Path(cell.out_dir) / "results.json").is_file():
            devices.add(began)
    return devices


def cell_device(cell: language_model.Config) -> str | None:
    """The device a cell's folder began training on (:data:`DEVICE_FILE`), if it names one."""
    path = Path(cell.out_dir) / DEVICE_FILE
    return path.read_text().strip() if path.is_file() else None


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


def learning_curve(cell: language_model.Config) -> list[dict[str, Any]]:
    path = Path(cell.out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == "epoch"]


# A cell converged when early stopping ended it, or when its last three epochs improved the
# validation perplexity by less than this fraction in all.
CONVERGED_IMPROVEMENT = 0.005
# The columns of --results_csv, in order (one row per cell).
RESULT_COLUMNS = (
    "corpus", "model", "vocab_size", "head", "d", "seed", "valid_ppl", "test_ppl", "epochs",
    "best_epoch", "stop_reason", "converged", "seconds_per_epoch", "train_seconds", "params",
    "valid_curve", "commit", "config_sha", "device", "lr", "dropout",
)  # fmt: skip


def converged(stop_reason: str, valid_ppls: list[float]) -> bool:
    """The study's criterion: stopped early, or the last 3 epochs improved validation < 0.5%.

    Example:
      >>> converged("epoch budget (6)", [300.0, 200.0, 150.0, 149.8, 149.6, 149.5])
      True
      >>> converged("epoch budget (4)", [300.0, 200.0, 150.0, 140.0])
      False
    """
    if stop_reason.startswith("early"):
        return True
    if len(valid_ppls) < 4:
        return False
    before, best_after = valid_ppls[-4], min(valid_ppls[-3:])
    return (before - best_after) / before < CONVERGED_IMPROVEMENT


# Model fields added after docs/results/ptb-transformer.csv was recorded, and their defaults
# (what every recorded cell had): config_sha leaves them out at those defaults.
ADDED_MODEL_FIELDS = {("transformer", "embedding_features"): None}


def config_sha(cell: language_model.Config) -> str:
    """A digest of what makes a cell's result: its config without folders and evaluation.

    The config as ``config.json`` records it (:func:`~bottleneck.runs.folder.to_jsonable`:
    ``"model": "transformer"`` and the model's fields under ``"transformer"``) with every other
    model family's group at its defaults, as when each config held both (the digests in
    docs/results/ stay valid); the head's options only those it takes; no ``out_dir``,
    ``evaluation``, ``data.data_dir`` or ``data.tfds_dir``; a model field added since the grid
    ran left out at its default (:data:`ADDED_MODEL_FIELDS`), so that it changes no digest of a
    config that does not use it.
    """
    tree = to_jsonable(cell)
    for model in language_model.MODELS:
        tree.setdefault(model.family, to_jsonable(model()))
    for (family, name), default in ADDED_MODEL_FIELDS.items():
        if tree[family].get(name, default) == default:
            tree[family].pop(name, None)
    tree.pop("out_dir")
    tree.pop("evaluation")
    # Only the options the head takes: a softmax cell is the same whatever K the mixtures use.
    tree["head"] = {"name": cell.head.name, **to_jsonable(cell.head.options())}
    tree["data"] = {k: v for k, v in tree["data"].items() if k not in ("data_dir", "tfds_dir")}
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def cell_row(
    config: Config, cell: language_model.Config, results: dict[str, Any], curve: list
) -> dict:
    """One cell's result row (the columns of :data:`RESULT_COLUMNS` when it finished)."""
    row: dict[str, Any] = {
        "corpus": cell.data.corpus,
        "model": cell.model.family,
        "vocab_size": cell.data.vocab_size,
        "head": cell.head.name,
        "d": cell.model.head_width,
        "seed": cell.seed,
        "status": results["status"],
    }
    if results["status"] != "done":
        return {**row, "error": results["error"]}
    valid = [r["valid_ppl"] for r in curve]
    return {
        **row,
        "valid_ppl": results["valid_ppl"],
        "test_ppl": results["test_ppl"],
        "epochs": results["epochs_trained"],
        "best_epoch": 1 + int(np.argmin(valid)) if valid else None,
        "stop_reason": results["stop_reason"],
        "converged": converged(results["stop_reason"], valid),
        "seconds_per_epoch": results["seconds_per_epoch"],
        "train_seconds": sum(r["seconds"] for r in curve),
        "params": results["num_params"],
        "valid_curve": " ".join(f"{v:.2f}" for v in valid),
        "commit": code_commit(),
        "config_sha": config_sha(cell),
        "device": accelerator(),  # what the seconds were measured on
        # the settings a tuned arm varies: the peak rate and the model's main dropout
        "lr": cell.optimizer.lr,
        "dropout": main_dropout(cell.model),
    }


def main_dropout(model: AWDLSTMConfig | TransformerConfig) -> float:
    """The dropout a tuned arm varies: the Transformer's on the residual branches (the tuned
    arm sets its embedding dropout alike), the AWD-LSTM's on its output."""
    return model.residual_dropout if isinstance(model, TransformerConfig) else model.dropout


def read_results_csv(path: Path) -> dict[tuple[str, int, int, str], dict[str, Any]]:
    """Rows of a results CSV by (head, d, seed, config_sha), values typed as :func:`cell_row`."""
    if not path.is_file():
        return {}
    rows = {}
    with path.open(newline="") as f:
        for raw in csv.DictReader(f):
            row: dict[str, Any] = dict(raw)
            for name in ("d", "seed", "epochs", "best_epoch", "params"):
                row[name] = int(row[name])
            for name in ("valid_ppl", "test_ppl", "seconds_per_epoch", "train_seconds"):
                row[name] = float(row[name])
            row["vocab_size"] = int(row["vocab_size"]) if row["vocab_size"] else None
            row["converged"] = row["converged"] == "True"
            row["status"] = "done"
            row.setdefault("device", "")  # a CSV of before the column: one unknown device
            for name in ("lr", "dropout"):  # before these columns: None (the CSV's recipe)
                row[name] = float(row[name]) if row.get(name) else None
            rows[(row["head"], row["d"], row["seed"], row["config_sha"])] = row
    return rows


def merge_results_csv(path: Path, row: dict[str, Any]) -> None:
    """Writes ``row`` into the CSV at ``path``, replacing the row of the same cell (atomically)."""
    rows = read_results_csv(path)
    key = (row["head"], row["d"], row["seed"])
    kept = [r for k, r in rows.items() if k[:3] != key] + [row]
    kept.sort(key=lambda r: (r["vocab_size"] or 0, r["d"], r["head"], r["seed"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in kept:
            writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in RESULT_COLUMNS})
    os.replace(tmp, path)


def curve_from_row(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"epoch": i + 1, "valid_ppl": float(v)} for i, v in enumerate(row["valid_curve"].split())
    ]


# The report's statistics: two-sided tests at this level, intervals at 1 - ALPHA, and the power
# the design is judged by.
ALPHA = 0.05
POWER = 0.8


def paired_t(gains: list[float] | np.ndarray, alpha: float = ALPHA) -> dict[str, float] | None:
    """The paired t statistics of per-seed gains (a head's gain over softmax of the same seed):
    their mean, std (ddof = 1), the two-sided ``1 - alpha`` t interval of the mean and the
    two-sided p-value of a zero mean (a one-sample t test on the gains, which is the paired t
    test of the two heads' perplexities). ``None`` below two gains (no spread to test with).

    Example:
      >>> t = paired_t([1.0, 2.0, 4.0])  # mean 7/3, std sqrt(7/3), t_{0.975, 2} = 4.303
      >>> round(t["ci_low"], 3), round(t["ci_high"], 3), round(t["p"], 4)  # t = 2.646 on 2 df
      (-1.461, 6.128, 0.1181)
    """
    gains = np.asarray(gains, dtype=float)
    n = len(gains)
    if n < 2:
        return None
    mean, std = float(gains.mean()), float(gains.std(ddof=1))
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * std / math.sqrt(n)
    if std > 0:
        p = float(stats.ttest_1samp(gains, 0.0).pvalue)
    else:  # identical gains: certain, whatever their value
        p = 1.0 if mean == 0 else 0.0
    return {"mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half, "p": p}


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (one family, in their order): the ``i``-th
    smallest of ``m`` becomes ``max_{j <= i} min(1, (m - j + 1) p_(j))``; comparing the adjusted
    values with alpha controls the family-wise error rate at alpha.

    Example:
      >>> holm([0.01, 0.04, 0.03])  # 3 x 0.01; max(0.06, 2 x 0.03); max(0.06, 1 x 0.04)
      [0.03, 0.06, 0.06]
    """
    m = len(p_values)
    adjusted, running = [0.0] * m, 0.0
    for position, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - position) * p_values[i]))
        adjusted[i] = round(running, 15)
    return adjusted


def paired_power(effect: float, spread: float, n: int, alpha: float = ALPHA) -> float:
    """The power of the two-sided paired t test at level ``alpha`` with ``n`` pairs against a
    true mean gain ``effect`` when the per-pair gains have std ``spread``: the probability
    that ``|T| > t_{1 - alpha/2, n - 1}`` for T noncentral t with n - 1 degrees of freedom and
    noncentrality ``effect sqrt(n) / spread``.

    Example:
      >>> round(paired_power(0.0, 1.0, 3), 3)  # no effect: the test's own level
      0.05
    """
    if not spread > 0 or n < 2:
        raise ValueError(f"the power needs a spread > 0 and n >= 2 pairs, got {spread}, {n}")
    df, noncentrality = n - 1, effect * math.sqrt(n) / spread
    critical = stats.t.ppf(1 - alpha / 2, df)
    # Each tail as a survival function (the lower one by symmetry): no 1 - (1 - tiny) round-off.
    return float(
        stats.nct.sf(critical, df, noncentrality) + stats.nct.sf(critical, df, -noncentrality)
    )


def detectable_gain(spread: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean gain that the two-sided paired t test with ``n`` pairs detects
    with probability ``power`` when the per-pair gains have std ``spread`` (in their units).

    Example:
      >>> round(detectable_gain(1.0, 3), 2)  # n = 3: 3.26 times the spread
      3.26
    """
    return float(
        optimize.brentq(lambda e: paired_power(e, spread, n, alpha) - power, 0.0, 100.0 * spread)
    )


def seeds_needed(
    effect: float, spread: float, alpha: float = ALPHA, power: float = POWER, most: int = 10_000
) -> int:
    """The fewest pairs (seeds, n >= 2) with which the two-sided paired t test detects a true
    mean gain ``effect`` with probability ``power``, per-pair std ``spread``.

    Example:
      >>> seeds_needed(1.0, 0.75)  # Issue #48's estimate: about 7 seeds at a spread of 0.75
      7
    """
    for n in range(2, most + 1):
        if paired_power(effect, spread, n, alpha) >= power:
            return n
    raise ValueError(f"more than {most} seeds needed for effect {effect} at spread {spread}")


def gain_trend(ds: list[int], gains: list[float], alpha: float = ALPHA) -> dict[str, float] | None:
    """The least-squares slope of ``gains`` on log2 d (the change of a head's gain per doubling
    of d) with its two-sided ``1 - alpha`` t interval (n - 2 degrees of freedom), over one point
    per cell (d, seed). The interval treats the cells as independent, which seeds that share a
    data order across d are not quite. ``None`` below three points or with a single d.

    Example:
      >>> trend = gain_trend([16, 32, 64], [2.0, 1.0, 0.5])
      >>> round(trend["slope"], 3), round(trend["ci_low"], 2), round(trend["ci_high"], 2)
      (-0.75, -2.58, 1.08)
    """
    x = np.log2(np.asarray(ds, dtype=float))
    if len(x) < 3 or np.ptp(x) == 0:
        return None
    fit = stats.linregress(x, np.asarray(gains, dtype=float))
    half = float(stats.t.ppf(1 - alpha / 2, len(x) - 2)) * fit.stderr
    return {
        "slope": float(fit.slope),
        "ci_low": float(fit.slope - half),
        "ci_high": float(fit.slope + half),
        "cells": len(x),
    }


def main_device(rows: list[dict[str, Any]]) -> str:
    """The device most finished cells trained on: the one whose seconds the report compares."""
    devices = [r["device"] for r in rows if r["status"] == "done"]
    return max(devices, key=devices.count, default="")


def summarize(rows: list[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """Mean +- std over seeds per head x d, and the gain over softmax at the same d, paired by
    seed, with its interval and p-value (:func:`_paired_gains`) and the p-value adjusted by
    Holm over all the grid's comparisons (``p_holm``); seconds (s/epoch, the cost over
    softmax) only of the cells trained on :func:`main_device`."""
    done = [r for r in rows if r["status"] == "done"]
    device = main_device(rows)
    table = []
    for d in config.ds:
        base = {r["seed"]: r for r in done if r["head"] == "softmax" and r["d"] == d}
        timed_base = {s: r for s, r in base.items() if r["device"] == device}
        for head in config.heads:
            cells = [r for r in done if r["head"] == head and r["d"] == d]
            if not cells:
                continue
            timed = [r for r in cells if r["device"] == device]
            test = np.array([r["test_ppl"] for r in cells])
            valid = np.array([r["valid_ppl"] for r in cells])
            entry = {
                "d": d,
                "head": head,
                "seeds": len(cells),
                "test_ppl": float(test.mean()),
                "test_std": float(test.std(ddof=1)) if len(cells) > 1 else None,
                "valid_ppl": float(valid.mean()),
                "epochs": float(np.mean([r["epochs"] for r in cells])),
                "early_stopped": sum(r["stop_reason"].startswith("early") for r in cells),
                "converged": sum(bool(r["converged"]) for r in cells),
                "s_per_epoch": (
                    float(np.median([r["seconds_per_epoch"] for r in timed])) if timed else None
                ),
                "params": cells[0]["params"],
            }
            if head != "softmax":
                entry.update(_paired_gains(cells, base))
                entry.update(_paired_cost(timed, timed_base))
            table.append(entry)
    _holm_over_grid(table)
    return table


def _paired_gains(cells: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The gain over softmax seed by seed, over the seeds where both finished (the heads of one
    seed share its data order and initial trunk): its mean in perplexity and in %, the per-seed
    gains in % (and their seeds), their spread (``None`` below two seeds), the paired t
    interval and p-value of :func:`paired_t` (``None`` below two seeds), how many seeds the
    head beats softmax in (``base``: softmax's rows at the same d, by seed), and the seeds whose
    head and softmax cells trained on different devices (``cross_device_seeds``); where there
    are such seeds, the same statistics over the others (``same_device``). Empty if no seed has
    both. A seed of the head alone counts in its mean perplexity, not in its gain: compared
    with softmax's other seeds, the seeds' own spread would pass for a head's gain."""
    paired = sorted((r for r in cells if r["seed"] in base), key=lambda r: r["seed"])
    if not paired:
        return {}
    gains = [_gain_pct(base[r["seed"]], r) for r in paired]
    crossing = [r["seed"] for r in paired if r["device"] != base[r["seed"]]["device"]]
    entry = {
        "gain_ppl": float(np.mean([base[r["seed"]]["test_ppl"] - r["test_ppl"] for r in paired])),
        **_gain_stats(gains),
        "seed_gains_pct": gains,
        "gain_seeds": [r["seed"] for r in paired],
        "cross_device_seeds": crossing,
    }
    if crossing:
        kept = [g for r, g in zip(paired, gains, strict=True) if r["seed"] not in crossing]
        entry["same_device"] = _gain_stats(kept) if kept else None
    return entry


def _gain_pct(softmax: dict[str, Any], cell: dict[str, Any]) -> float:
    return float(100.0 * (softmax["test_ppl"] - cell["test_ppl"]) / softmax["test_ppl"])


def _gain_stats(gains: list[float]) -> dict[str, Any]:
    """Mean, spread, interval, p-value and wins of per-seed gains in % (:func:`paired_t`)."""
    t = paired_t(gains)
    return {
        "gain_pct": float(np.mean(gains)),
        "gain_pct_std": None if t is None else t["std"],
        "gain_ci": None if t is None else (t["ci_low"], t["ci_high"]),
        "p_value": None if t is None else t["p"],
        "better_seeds": sum(g > 0 for g in gains),
        "paired_seeds": len(gains),
    }


def _holm_over_grid(table: list[dict[str, Any]]) -> None:
    """Sets ``p_holm`` on every entry with a p-value: Holm over all head x d comparisons of the
    grid (one family), and ``comparisons``, their number."""
    tested = [e for e in table if e.get("p_value") is not None]
    for e, p in zip(tested, holm([e["p_value"] for e in tested]), strict=True):
        e["p_holm"], e["comparisons"] = p, len(tested)


def _paired_cost(cells: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The head's seconds per epoch over softmax's, seed by seed (a seed's cells usually run on
    one machine, so its ratio cancels the machine's speed, which the seeds' seconds may not share):
    the median over the seeds where both finished, and the smallest and largest. Empty if no
    seed has both."""
    ratios = [
        r["seconds_per_epoch"] / base[r["seed"]]["seconds_per_epoch"]
        for r in cells
        if r["seed"] in base
    ]
    if not ratios:
        return {}
    return {
        "time_ratio": float(np.median(ratios)),
        "time_ratio_min": float(min(ratios)),
        "time_ratio_max": float(max(ratios)),
    }


def title(config: Config, rows: list[dict[str, Any]]) -> str:
    """The results page's title, ending in "partial" while cells are pending."""
    trunk = config.trunk
    partial = " — partial" if any(r["status"] == "pending" for r in rows) else ""
    fixed = " (fixed trunk: decoder E Q)" if config.embedding == "fixed" else ""
    return (
        f"LM study: {trunk.model.family}{fixed} on {trunk.data.corpus} "
        f"({trunk.data.vocab_size or 'all'} words), heads x d x seeds {list(config.seeds)}{partial}"
    )


def trained_seconds(rows: list[dict[str, Any]]) -> float:
    """The finished cells' training seconds in all (their epochs', not evaluation's)."""
    return sum(r["train_seconds"] for r in rows if r["status"] == "done")


def markdown(table: list[dict[str, Any]], rows: list[dict[str, Any]], config: Config) -> str:
    """The results page's body: what the grid is, the table of heads x d, the gains' statistics
    (intervals, p-values, Holm, the design's power, the trend with d, the pairs that cross
    devices), the head x d grid beside the published gains, the cost, the compute."""
    trunk, decimals = config.trunk, _decimals(table)
    done = [r for r in rows if r["status"] == "done"]
    lines = [
        _design_text(table, done, config),
        "",
        "Test perplexity of the best-validation model, mean ± std over seeds; gain = softmax's "
        "test perplexity minus the head's at the same d and seed (positive: better than "
        "softmax), averaged over the seeds where both finished (a head and softmax of one seed "
        "share its data order and initial trunk); its ± is the std of those per-seed gains, and "
        "'better in' counts the seeds in which the head beats softmax. "
        f"Budget {trunk.training.epochs} epochs per cell, early stopping with patience "
        f"{trunk.training.patience}; "
        "'stopped early' counts the seeds whose validation perplexity stopped improving before "
        "the budget ended; 'converged' those converged by the study's stopping rule: stopped "
        "early, or their last three epochs improved validation by less than "
        f"{100 * CONVERGED_IMPROVEMENT:g}% in all.",
        "",
        markdown_table([_table_row(e, decimals) for e in table]),
    ]
    tested = [e for e in table if e.get("p_value") is not None]
    if tested:
        lines += [
            "",
            f"The gains' statistics: the paired {1 - ALPHA:.0%} confidence interval of the mean "
            "gain in % (a t interval over the per-seed gains, ddof = 1), the p-value of the "
            "paired t test (two-sided) and the same p-value corrected for multiplicity by Holm "
            f"over all {tested[0]['comparisons']} head × d comparisons of the grid. Where the "
            "interval spans 0 the reading is 'no detectable difference'; otherwise a gain or a "
            f"loss at {1 - ALPHA:.0%} for that comparison alone, and 'after Holm' where the "
            f"corrected p is below {ALPHA:g} too. 'Devices' names the seeds whose head and "
            "softmax cells trained on different devices (below: the gains without them).",
            "",
            markdown_table([_stats_row(e) for e in tested]),
        ]
    grid = gains_by_d(table, config, decimals)
    lines += [
        "",
        "The same gains, a column per d (softmax's row: its test perplexity; the others': mean "
        f"gain over softmax in %, its paired {1 - ALPHA:.0%} interval, and in how many paired "
        "seeds the head wins; † where a seed's pair crosses devices)",
    ]
    if grid and "published (PTB)" in grid[0]:
        lines[-1] += ", and the head's published gain on PTB, " + _published_text()
    lines[-1] += ":"
    lines += ["", markdown_table(grid)]
    if tested:
        lines += ["", _power_text(tested)]
        trends = gain_trends(table, config)
        if trends:
            lines += [
                "",
                "The trend with d: each head's least-squares slope of the per-seed gain (in "
                f"points of %) on log2 d, over its {trends[0]['cells']} cells (d, seed), with "
                f"its {1 - ALPHA:.0%} t interval (n - 2 degrees of freedom; the seeds of one "
                "head share their data order across d, so the cells are not quite independent "
                "and the interval is, if anything, too narrow). " + _trend_caveat(table, config),
                "",
                markdown_table([_trend_row(t) for t in trends]),
            ]
        crossing = [e for e in tested if e["cross_device_seeds"]]
        if crossing:
            lines += [
                "",
                "Pairs that cross devices: a head and its softmax of one seed trained on "
                "different devices, whose float arithmetic differs, so that a device's effect "
                "passes for the head's in those seeds. Their gains with every seed "
                "and without the crossing ones:",
                "",
                markdown_table([_crossing_row(e) for e in crossing]),
            ]
    costs = costs_by_d(table, config)
    if costs:
        lines += [
            "",
            "Cost: each head's seconds per epoch over softmax's at the same d and seed, the "
            "median over the paired seeds (smallest–largest). A seed's cells run one after "
            "another, usually on one machine, so the ratio cancels the machine's speed, which "
            "the s/epoch column above does not where seeds ran on different machines"
            + (
                "; the last column is the published ratio on PTB (the seconds per epoch in the "
                "sources above, on a GPU)"
                if "published (PTB)" in costs[0]
                else ""
            )
            + ":",
            "",
            markdown_table(costs),
        ]
    if config.tuned_csvs:
        lines += ["", _tuned_text(tuned_arm(config, rows), config)]
    if config.probe_csv is not None:
        lines += ["", _probe_text(convergence_probe(config, rows, table), config)]
    if done:
        lines += ["", _compute_text(done, main_device(rows))]
    pending = [r for r in rows if r["status"] == "pending"]
    if pending:
        lines += [
            "",
            f"**Partial**: {len(rows) - len(pending)} of {len(rows)} cells done; pending: "
            + ", ".join(cell_name(r["head"], r["d"], r["seed"]) for r in pending)
            + ".",
        ]
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        lines += ["", "Failed cells (rerun the command to retry them):", ""]
        lines += [f"- {cell_name(r['head'], r['d'], r['seed'])}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def _setting(row: dict[str, Any], config: Config) -> tuple[float, float]:
    """A row's (peak lr, dropout); a row of before those columns has its CSV's recipe, which
    for --results_csv is this config's trunk."""
    if row.get("lr") is None:
        return config.trunk.optimizer.lr, main_dropout(config.trunk.model)
    return row["lr"], row["dropout"]


def _setting_text(setting: tuple[float, float]) -> str:
    return f"lr {setting[0]:g}, dropout {setting[1]:g}"


def tuned_arm(config: Config, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tuned arm: per head, the setting (one CSV of ``--tuned_csvs``, or ``--results_csv``
    for the recipe) of the lowest validation perplexity at the first seed, then that setting's
    cells of the arm's seeds (those the tuned CSVs hold) against softmax's at softmax's own
    choice, paired by seed (:func:`_paired_gains`), and the one-recipe gain over the same seeds
    beside it. The arm's d is the largest of the tuned CSVs'; one entry per head with a cell
    there, in the order of ``--heads``.

    A setting's rows are read from its CSV whatever their config digest: the CSV holds one
    setting, and each row says its own (``lr``, ``dropout``)."""
    tuned = [row for path in config.tuned_csvs for row in read_results_csv(Path(path)).values()]
    if not tuned:
        return []
    d, seeds = max(r["d"] for r in tuned), {r["seed"] for r in tuned}
    first_seed = min(seeds)
    recorded = read_results_csv(Path(config.results_csv)).values() if config.results_csv else []
    arms: dict[tuple[float, float], dict[tuple[str, int], dict[str, Any]]] = {}
    for row in (*recorded, *tuned):
        if row["d"] == d and row["seed"] in seeds:
            arms.setdefault(_setting(row, config), {})[(row["head"], row["seed"])] = row
    recipe = {(r["head"], r["seed"]): r for r in rows if r["status"] == "done" and r["d"] == d}
    entries, chosen_cells = [], {}
    for head in config.heads:
        first = {
            s: cells[(head, first_seed)] for s, cells in arms.items() if (head, first_seed) in cells
        }
        if not first:
            continue
        chosen = min(first, key=lambda s: first[s]["valid_ppl"])
        cells = [arms[chosen][(head, s)] for s in sorted(seeds) if (head, s) in arms[chosen]]
        chosen_cells[head] = cells
        entries.append({
            "head": head, "d": d, "setting": chosen, "seeds": [r["seed"] for r in cells],
            "first_seed_valid": {s: first[s]["valid_ppl"] for s in sorted(first)},
            "test_ppl": float(np.mean([r["test_ppl"] for r in cells])),
        })  # fmt: skip
    base = {r["seed"]: r for r in chosen_cells.get("softmax", [])}
    for e in entries:
        if e["head"] == "softmax":
            continue
        e["tuned"] = _paired_gains(chosen_cells[e["head"]], base)
        paired = e["tuned"].get("gain_seeds", [])
        if all((h, s) in recipe for h in ("softmax", e["head"]) for s in paired) and paired:
            e["recipe"] = _paired_gains(
                [recipe[(e["head"], s)] for s in paired],
                {s: recipe[("softmax", s)] for s in paired},
            )
    return entries


def _tuned_text(entries: list[dict[str, Any]], config: Config) -> str:
    if not entries:
        return "Tuned arm: no cell recorded yet in " + ", ".join(config.tuned_csvs) + "."
    settings = sorted({s for e in entries for s in e["first_seed_valid"]})
    table = []
    for e in entries:
        row = {"head": e["head"], "chosen": _setting_text(e["setting"])}
        for s in settings:
            valid = e["first_seed_valid"].get(s)
            row[_setting_text(s)] = "—" if valid is None else f"{valid:.2f}"
        row["seeds"] = " ".join(map(str, e["seeds"]))
        row["test ppl"] = f"{e['test_ppl']:.2f}"
        for arm in ("tuned", "recipe"):
            stats_ = e.get(arm) or {}
            row[f"gain, {arm} (%)"] = (
                "—" if not stats_ else
                f"{stats_['gain_pct']:+.2f} {_interval_text(stats_['gain_ci'])}"
            )  # fmt: skip
        table.append(row)
    return "\n".join([
        f"**Tuned arm** at d = {entries[0]['d']}: each head's peak learning rate and dropout "
        "chosen by the validation perplexity of its first seed (one column a setting), then "
        "its seeds at that choice; 'gain, tuned' is over softmax at softmax's own choice, "
        "paired by seed, with its paired "
        f"{1 - ALPHA:.0%} interval; 'gain, recipe' is the one-recipe grid's gain over the same "
        "seeds. The tuned arm's choice uses the first seed's validation, so that seed's gain is "
        "not a held-out estimate.",
        "",
        markdown_table(table),
    ])  # fmt: skip


def convergence_probe(
    config: Config, rows: list[dict[str, Any]], table: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each cell of ``--probe_csv`` (a longer budget) beside this grid's cell of the same head,
    d and seed: the change of test perplexity in %, and the half-width of the gain interval it
    is to be read against (at that d: the head's own, or for softmax the widest of the probed
    heads')."""
    probed = read_results_csv(Path(config.probe_csv)).values()
    grid = {(r["head"], r["d"], r["seed"]): r for r in rows if r["status"] == "done"}
    gains = {(e["head"], e["d"]): e for e in table if e.get("gain_ci") is not None}
    entries = []
    for p in sorted(probed, key=lambda r: (r["d"], r["head"] != "softmax", r["head"])):
        cell = grid.get((p["head"], p["d"], p["seed"]))
        if cell is None:
            continue
        heads = [p["head"]] if p["head"] != "softmax" else [
            q["head"] for q in probed if q["d"] == p["d"] and q["head"] != "softmax"
        ]  # fmt: skip
        widths = [_half_width(gains[(h, p["d"])]) for h in heads if (h, p["d"]) in gains]
        entries.append({
            "head": p["head"], "d": p["d"], "seed": p["seed"],
            "epochs": (cell["epochs"], p["epochs"]),
            "test_ppl": (cell["test_ppl"], p["test_ppl"]),
            "change_pct": 100.0 * (p["test_ppl"] - cell["test_ppl"]) / cell["test_ppl"],
            "half_width": max(widths) if widths else None,
            "same_device": p["device"] == cell["device"],
        })  # fmt: skip
    return entries


def _half_width(e: dict[str, Any]) -> float:
    low, high = e["gain_ci"]
    return (high - low) / 2


def _probe_text(entries: list[dict[str, Any]], config: Config) -> str:
    if not entries:
        return f"Convergence probe: no cell of {config.probe_csv} has its grid cell yet."
    table = [
        {
            "d": e["d"],
            "head": e["head"],
            "seed": e["seed"],
            "epochs (grid → probe)": f"{e['epochs'][0]} → {e['epochs'][1]}",
            "test ppl (grid → probe)": f"{e['test_ppl'][0]:.2f} → {e['test_ppl'][1]:.2f}",
            "change (%)": f"{e['change_pct']:+.2f}",
            "gain's half-width (%)": "—" if e["half_width"] is None else f"{e['half_width']:.2f}",
            "within": (
                "—" if e["half_width"] is None
                else "yes" if abs(e["change_pct"]) < e["half_width"] else "no"
            ),
            "device": "same" if e["same_device"] else "differs",
        }
        for e in entries
    ]  # fmt: skip
    return "\n".join([
        "**Convergence probe**: cells retrained with a longer budget and the same schedule's "
        f"shape ({config.probe_csv}) beside the grid's; 'within' says whether the change of "
        f"test perplexity is smaller than the half-width of the gain's {1 - ALPHA:.0%} interval "
        "at that d (for softmax, the widest of the probed heads'), i.e. whether a longer budget "
        "moves a cell less than the comparisons can resolve.",
        "",
        markdown_table(table),
    ])  # fmt: skip


def _design_text(table: list[dict[str, Any]], done: list[dict[str, Any]], config: Config) -> str:
    """What the grid is, in the report's first paragraph: the trunk and what d sizes, the
    seeds, the devices, the heads' settings beside the papers', the learning rate's schedule
    and whether the cells that ended their budget were still improving."""
    trunk, model = config.trunk, config.trunk.model
    if model.family == "transformer" and config.embedding == "fixed":
        what = (
            f"a fixed trunk: {model.num_layers} pre-norm Transformer layers of width "
            f"{model.d_model} with the same input embedding at every d (a "
            f"{model.embedding_features or model.d_model}-wide table, tied with the head's "
            "decoder through a learned map Q: W = E Q), so only the head changes with d"
        )
    elif model.family == "transformer":
        what = (
            f"a factorized-embedding trunk: {model.num_layers} pre-norm Transformer layers of "
            f"width {model.d_model} whose input embedding also has width d (a d-wide table "
            f"tied with the head's decoder, projected up to {model.d_model}), so d sizes the "
            "input embedding as well as the head's input"
        )
    else:
        what = (
            f"a {model.nlayers}-layer AWD-LSTM whose last layer, tied embedding and head input "
            "have width d"
        )
    parts = [f"The grid: {what}; seeds {', '.join(map(str, config.seeds))}"]
    softmax = sorted((e for e in table if e["head"] == "softmax"), key=lambda e: e["d"])
    if len(softmax) > 1:
        parts[-1] += (
            f"; softmax's parameters go from {softmax[0]['params'] / 1e6:.2f} M at d = "
            f"{softmax[0]['d']} to {softmax[-1]['params'] / 1e6:.2f} M at d = {softmax[-1]['d']}"
        )
    devices = sorted({r["device"] for r in done})
    if devices:
        parts[-1] += "; " + ", ".join(
            f"{sum(r['device'] == dev for r in done)} cells trained on {dev or 'an unrecorded device'}"
            for dev in devices
        )
    parts[-1] += "."
    heads, head = set(config.heads), trunk.head
    settings = []
    if heads & {"mos", "moss", "mos_plif", "mixtape"}:
        settings.append(
            f"the mixtures at K = {head.num_components} with {head.latent} latents (Yang et al. "
            "2018: K = 15, tanh)"
        )
    if "mixtape" in heads and head.shared_gate_below is None:
        settings.append("Mixtape without gate sharing")
    elif "mixtape" in heads:
        settings.append(
            f"Mixtape with gate sharing (words seen fewer than {head.shared_gate_below:g} times "
            "in training share one gate)"
        )
    if heads & {"plif", "mos_plif"}:
        settings.append(f"PLIF at {head.num_knots:,} knots (Ganea et al. 2019: 10^5)")
    if settings:
        parts.append("Heads: " + ", ".join(settings) + ".")
    optimizer = trunk.optimizer
    if optimizer.decay_epochs is not None:
        parts.append(
            f"The learning rate decays (a cosine) to {optimizer.final_lr_fraction:.0%} of its "
            f"peak at epoch {optimizer.decay_epochs} and stays there: 'converged' below means "
            "converged by the study's stopping rule, not a converged model."
        )
    budget = [r for r in done if not r["stop_reason"].startswith("early")]
    if budget:
        improving = [r for r in budget if _last_epoch_improved(r)]
        parts.append(
            f"Of the {len(budget)} cells that ended their {trunk.training.epochs}-epoch budget, "
            f"{len(improving)} still improved validation in their last epoch."
        )
    return " ".join(parts)


def _last_epoch_improved(row: dict[str, Any]) -> bool:
    curve = [float(v) for v in row["valid_curve"].split()]
    return len(curve) >= 2 and curve[-1] < min(curve[:-1])


def _interval_text(ci: tuple[float, float] | None) -> str:
    return "—" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def _reading(e: dict[str, Any]) -> str:
    """'no detectable difference' where the interval spans 0, else a gain or loss (and whether
    it holds after Holm)."""
    low, high = e["gain_ci"]
    if low <= 0 <= high:
        return "no detectable difference"
    word = "gain" if low > 0 else "loss"
    return f"{word}, after Holm" if e["p_holm"] < ALPHA else f"{word}, not after Holm"


def _stats_row(e: dict[str, Any]) -> dict[str, Any]:
    return {
        "d": e["d"],
        "head": e["head"],
        "gain (%)": _gain_pct_text(e),
        f"{1 - ALPHA:.0%} CI": _interval_text(e["gain_ci"]),
        "p": f"{e['p_value']:.3f}",
        "p (Holm)": f"{e['p_holm']:.3f}",
        "better in": _better_in_text(e),
        "reading": _reading(e),
        "devices": _crossing_text(e) or "same",
    }


def _crossing_text(e: dict[str, Any]) -> str:
    seeds = e.get("cross_device_seeds") or []
    return ", ".join(f"seed {s} crosses" for s in seeds)


def _crossing_row(e: dict[str, Any]) -> dict[str, Any]:
    kept = e["same_device"]
    return {
        "d": e["d"],
        "head": e["head"],
        "crossing": ", ".join(f"seed {s}" for s in e["cross_device_seeds"]),
        "gain, every seed (%)": f"{e['gain_pct']:+.2f} {_interval_text(e['gain_ci'])}",
        "without them (%)": (
            "—" if kept is None else f"{kept['gain_pct']:+.2f} {_interval_text(kept['gain_ci'])}"
        ),
        "better in, without": "—" if kept is None else _better_in_text(kept),
    }


def design_spreads(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-seed spread of the gains that the design's power is judged by: the median of
    the comparisons' spreads, their pooled value (root mean square) and the pooled value at each
    d, each with the number of comparisons and of seeds a comparison has (the smallest)."""
    tested = [e for e in table if e.get("gain_pct_std") is not None]
    groups = [("median over all comparisons", tested, "median")]
    groups.append(("pooled over all comparisons", tested, "pooled"))
    for d in sorted({e["d"] for e in tested}):
        groups.append((f"pooled at d = {d}", [e for e in tested if e["d"] == d], "pooled"))
    spreads = []
    for name, entries, how in groups:
        stds = np.array([e["gain_pct_std"] for e in entries])
        spread = np.median(stds) if how == "median" else np.sqrt(np.mean(stds**2))
        spreads.append(
            {
                "spread": name,
                "value": float(spread),
                "comparisons": len(entries),
                "seeds": min(e["paired_seeds"] for e in entries),
            }
        )
    return spreads


def _power_text(tested: list[dict[str, Any]]) -> str:
    spreads = design_spreads(tested)
    rows = [
        {
            "spread of the per-seed gains": s["spread"],
            "points of %": f"{s['value']:.2f}",
            # No spread at all (identical gains): nothing to size a test with.
            f"detectable with {POWER:.0%} power, n = {s['seeds']}": (
                f"{detectable_gain(s['value'], s['seeds']):.2f}" if s["value"] > 0 else "—"
            ),
            f"seeds for {POWER:.0%} power at 1 point": (
                str(seeds_needed(1.0, s["value"])) if s["value"] > 0 else "—"
            ),
        }
        for s in spreads
    ]
    return (
        f"The design's power: the smallest true mean gain that the paired t test (two-sided, "
        f"alpha {ALPHA:g}) detects with {POWER:.0%} power with this grid's seeds, and the seeds "
        f"such a test needs for {POWER:.0%} power against a gain of 1 point of % (noncentral t), "
        "at the observed spread of the per-seed gains:\n\n" + markdown_table(rows)
    )


def gain_trends(table: list[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """Each head's :func:`gain_trend` over its paired cells (d, seed); heads with fewer than
    three cells or a single d are left out."""
    trends = []
    for head in config.heads:
        entries = [e for e in table if e["head"] == head and "seed_gains_pct" in e]
        ds = [e["d"] for e in entries for _ in e["seed_gains_pct"]]
        trend = gain_trend(ds, [g for e in entries for g in e["seed_gains_pct"]])
        if trend is not None:
            trends.append({"head": head, **trend})
    return trends


def _trend_row(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "head": t["head"],
        "gain per doubling of d (points of %)": f"{t['slope']:+.2f}",
        f"{1 - ALPHA:.0%} CI": _interval_text((t["ci_low"], t["ci_high"])),
        "cells": t["cells"],
    }


def _trend_caveat(table: list[dict[str, Any]], config: Config) -> str:
    if config.trunk.model.family != "transformer":
        return "d also widens the LSTM's last layer and the embedding, not the head alone."
    return (
        "A trend, not the bottleneck's effect: d also sizes the input embedding (the "
        "factorized trunk above), so the model grows with d as well as the head's input; a "
        "fixed-trunk grid would separate the two."
    )


def _compute_text(done: list[dict[str, Any]], device: str) -> str:
    """The finished cells' training hours, by device where some trained elsewhere than on
    ``device`` (whose seconds alone the s/epoch column and the cost grid compare)."""
    devices = sorted({r["device"] for r in done}, key=lambda dev: dev != device)
    by_device = {dev: [r for r in done if r["device"] == dev] for dev in devices}
    hours = {dev: trained_seconds(cells) / 3600 for dev, cells in by_device.items()}
    not_counted = (
        "the sum of their training seconds; evaluation, the consequences' measurements and "
        "time lost to interruptions not counted"
    )
    if len(devices) == 1:
        return (
            f"Compute: the {len(done)} finished cells trained for {hours[device]:.1f} hours in "
            f"all ({not_counted})."
        )
    spent = " and ".join(
        f"{hours[dev]:.1f} hours on {dev or 'an unrecorded device'} for {len(by_device[dev])} cells"
        for dev in devices
    )
    others = [r for r in done if r["device"] != device]
    return (
        f"Compute: the {len(done)} finished cells trained for {spent} ({not_counted}). The "
        f"s/epoch column and the cost grid compare only the cells trained on {device}: "
        + ", ".join(cell_name(r["head"], r["d"], r["seed"]) for r in others)
        + " count in perplexity alone."
    )


def gains_by_d(table: list[dict[str, Any]], config: Config, decimals: int) -> list[dict[str, str]]:
    """The summary as a head x d grid, short enough for a README: softmax's test perplexity,
    then each head's mean paired gain over it in %, its paired 95% interval (with two or more
    seeds), the seeds it wins in, and † where a seed's pair crosses devices ("—" where no seed
    is paired, blank where no cell); a head or d with no cell at all has no row or column. For
    a study of PTB's 10,000 words, a last column gives the head's published gain there against
    the softmax it was published beside (:data:`PUBLISHED_PTB`)."""
    entries, heads, ds, published = _grid_axes(table, config)
    grid = []
    for head in heads:
        cells = {"head": f"{head} (test ppl)" if head == "softmax" else head}
        for d in ds:
            e = entries.get((head, d))
            if e is None:
                text = ""
            elif head == "softmax":
                text = _test_ppl_text(e, decimals)
            elif "gain_pct" in e:
                interval = "" if e["gain_ci"] is None else f" {_interval_text(e['gain_ci'])}"
                crossing = "†" if e["cross_device_seeds"] else ""
                text = f"{e['gain_pct']:+.2f}{interval} ({_better_in_text(e)}){crossing}"
            else:
                text = "—"
            cells[f"d = {d}"] = text
        if published:
            if head == "softmax":
                cells["published (PTB)"] = _published_softmax_text()
            else:
                cells["published (PTB)"] = (
                    PUBLISHED_PTB[head].text() if head in PUBLISHED_PTB else "—"
                )
        grid.append(cells)
    return grid


def _grid_axes(
    table: list[dict[str, Any]], config: Config
) -> tuple[dict[tuple[str, int], dict[str, Any]], list[str], list[int], bool]:
    """What a head x d grid of the summary shows: its entries by (head, d), the heads and the
    d's that have a cell (in the config's order), and whether the study is PTB's 10,000 words,
    where :data:`PUBLISHED_PTB`'s column applies."""
    entries = {(e["head"], e["d"]): e for e in table}
    heads = [h for h in config.heads if h in {h_ for h_, _ in entries}]
    ds = [d for d in config.ds if d in {d_ for _, d_ in entries}]
    published = config.trunk.data.corpus == "ptb" and config.trunk.data.vocab_size is None
    return entries, heads, ds, published


def costs_by_d(table: list[dict[str, Any]], config: Config) -> list[dict[str, str]]:
    """Each head's seconds per epoch over softmax's, a column per d: the median over the paired
    seeds and, with two or more, the smallest and largest ("—" where no seed is paired, blank
    where no cell); for a study of PTB's 10,000 words, a last column gives the published ratio
    where :data:`PUBLISHED_PTB` has both seconds. No softmax row, and none without a cell."""
    entries, heads, ds, published = _grid_axes(table, config)
    grid = []
    for head in (h for h in heads if h != "softmax"):
        cells = {"head": head}
        for d in ds:
            e = entries.get((head, d))
            cells[f"d = {d}"] = "" if e is None else _time_ratio_text(e)
        if published:
            result = PUBLISHED_PTB.get(head)
            cells["published (PTB)"] = (
                result.time_ratio_text(PUBLISHED_PTB["softmax"]) if result else "—"
            )
        grid.append(cells)
    return grid


def _time_ratio_text(e: dict[str, Any]) -> str:
    if "time_ratio" not in e:
        return "—"
    if e["time_ratio_min"] == e["time_ratio_max"]:
        return f"{e['time_ratio']:.2f}×"
    return f"{e['time_ratio']:.2f}× ({e['time_ratio_min']:.2f}–{e['time_ratio_max']:.2f})"


@dataclasses.dataclass(frozen=True)
class PublishedResult:
    """A head's published test perplexity on PTB (10,000 words, without finetuning) beside
    the softmax it was published against (``softmax_ppl`` is None for softmax's own row), and
    its seconds per epoch where the table gives them. ``source`` names the table and the row of
    each number; ``other_model`` marks a comparison of two different models (not one trunk
    with two heads)."""

    source: str
    head_ppl: float
    softmax_ppl: float | None = None
    seconds_per_epoch: float | None = None
    other_model: bool = False

    def text(self) -> str:
        """The published gain and the softmax it is against, as the grid's last column writes
        it (softmax's row: its perplexity)."""
        if self.softmax_ppl is None:
            return f"{self.head_ppl:g}"
        gain = 100.0 * (self.softmax_ppl - self.head_ppl) / self.softmax_ppl
        return f"{gain:+.2f}% vs {self.softmax_ppl:g}" + (
            " (other model)" if self.other_model else ""
        )

    def time_ratio_text(self, softmax: PublishedResult) -> str:
        """Its seconds per epoch over ``softmax``'s, as the cost grid writes it."""
        if self.seconds_per_epoch is None or softmax.seconds_per_epoch is None:
            return "—"
        return f"{self.seconds_per_epoch / softmax.seconds_per_epoch:.2f}×"


#: The seeds' claims, for the report's last column, each against the softmax it was published
#: beside, named by table and row: AWD-LSTMs of 24-27 M parameters at test perplexity ~56-59,
#: heavily regularized and trained for hundreds of epochs, whose head input is 400 wide
#: (softmax, sigsoftmax, PLIF: the embedding size) or 280 (MoS); ours have 0.6-2.1 M
#: parameters at 110-145. Test perplexity before finetuning and dynamic evaluation. Mixtape's
#: paper (Yang et al. 2019) reports PTB, but its table is not among this project's sources.
PUBLISHED_PTB: dict[str, PublishedResult] = {
    "softmax": PublishedResult(
        "AWD-LSTM (Merity et al. 2017; 24.2 M parameters, head input 400) as tabulated by Ganea "
        "et al. 2019, row 'Linear-softmax w/ AWD-LSTM, w/o finetune': 58.37, ~60 s per epoch",
        58.37,
        seconds_per_epoch=60.0,
    ),
    "sigsoftmax": PublishedResult(
        "Kanai et al. 2018, Table 4, row 'Test w/o finetune' (3-layer AWD-LSTM, head input 400, "
        "mean of their runs): sigsoftmax 58.4 against their own softmax 58.8 (column Softmax), "
        "not the 58.37 of Ganea et al.'s table",
        58.4,
        58.8,
    ),
    "plif": PublishedResult(
        "Ganea et al. 2019, row 'LMS-PLIF, 10^5 knots w/ AWD-LSTM, w/o finetune' (24.4 M "
        "parameters): 57.25 against the softmax row's 58.37, ~70 s per epoch",
        57.25,
        58.37,
        seconds_per_epoch=70.0,
    ),
    "mos": PublishedResult(
        "Yang et al. 2018's MoS (K = 15, tanh latents) as tabulated by Ganea et al. 2019, row "
        "'MoS, K = 15 w/ AWD-LSTM, w/o finetune': 56.43 against the softmax row's 58.37, ~150 s "
        "per epoch. A different model, not another head on the same one: 26.6 M parameters "
        "against 24.2 M, LSTM widths 960, 960, 620 and a 280-wide head input against 1150, "
        "1150, 400 and 400, its own dropouts, batch size and learning rate",
        56.43,
        58.37,
        seconds_per_epoch=150.0,
        other_model=True,
    ),
}


def _published_softmax_text() -> str:
    """Softmax's published perplexities that the gains are against, the first its own row's."""
    baselines = [PUBLISHED_PTB["softmax"].head_ppl]
    baselines += [r.softmax_ppl for r in PUBLISHED_PTB.values() if r.softmax_ppl is not None]
    return ", ".join(f"{b:g}" for b in dict.fromkeys(baselines))


def _published_text() -> str:
    """The grid's legend for its published column: each source, table and row."""
    return (
        "against the softmax it was published beside (test perplexity without finetuning; "
        "softmax's row gives those softmaxes): "
        + "; ".join(f"{head}: {r.source}" for head, r in PUBLISHED_PTB.items())
        + " (— where no PTB number is in this project's sources)"
    )


def _decimals(table: list[dict[str, Any]]) -> int:
    """Decimals that give the smallest mean test perplexity four significant digits (140.8 at
    PTB's 10,000 words, 6.166 at the control's 64), so that its gains read as more than 0.0."""
    smallest = min((e["test_ppl"] for e in table), default=100.0)
    return max(1, 3 - math.floor(math.log10(smallest)))


def _table_row(e: dict[str, Any], decimals: int) -> dict[str, Any]:
    return {
        "d": e["d"],
        "head": e["head"],
        "test ppl": _test_ppl_text(e, decimals),
        "gain (ppl)": f"{e['gain_ppl']:+.{decimals}f}" if "gain_ppl" in e else "—",
        "gain (%)": _gain_pct_text(e),
        "better in": _better_in_text(e),
        "valid ppl": f"{e['valid_ppl']:.{decimals}f}",
        "epochs": round(e["epochs"], 1),
        "stopped early": f"{e['early_stopped']}/{e['seeds']}",
        "converged": f"{e['converged']}/{e['seeds']}",
        "s/epoch": "—" if e["s_per_epoch"] is None else round(e["s_per_epoch"]),
        "params": f"{e['params']:,}",
    }


def _test_ppl_text(e: dict[str, Any], decimals: int) -> str:
    std = f" ± {e['test_std']:.{decimals}f}" if e["test_std"] is not None else ""
    return f"{e['test_ppl']:.{decimals}f}{std}"


def _better_in_text(e: dict[str, Any]) -> str:
    return f"{e['better_seeds']}/{e['paired_seeds']}" if "gain_pct" in e else "—"


def _gain_pct_text(e: dict[str, Any]) -> str:
    if "gain_pct" not in e:
        return "—"
    std = f" ± {e['gain_pct_std']:.2f}" if e["gain_pct_std"] is not None else ""
    return f"{e['gain_pct']:+.2f}{std}"


def plot_vs_d(table: list[dict[str, Any]], config: Config, path: Path) -> None:
    """Test perplexity against d (left) and each head's gain over softmax at the same d (right),
    a line per head, error bars the std over seeds on the left and the paired 95% interval of
    the mean gain on the right (each seed's gain a hollow circle beside its bar). The heads sit slightly apart along d
    so that their error bars do not hide one another."""
    fig, (ax, gain_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {head: f"C{i}" for i, head in enumerate(config.heads)}
    for i, head in enumerate(config.heads):
        entries = [e for e in table if e["head"] == head]
        gains = [e for e in entries if "gain_pct" in e]
        # On the log2 axis a multiplicative nudge: the heads spread over about +-6% of d.
        nudge = 2.0 ** (0.16 * (i / max(len(config.heads) - 1, 1) - 0.5))
        for axis, rows, value, spread in (
            (ax, entries, "test_ppl", lambda e: e["test_std"] or 0.0),
            (gain_ax, gains, "gain_pct", _half_interval),
        ):
            if rows:
                axis.errorbar(
                    [e["d"] * nudge for e in rows],
                    [e[value] for e in rows],
                    yerr=[spread(e) for e in rows],
                    marker="o",
                    capsize=3,
                    color=colors[head],
                    label=head,
                )
        for e in gains:
            gain_ax.plot(
                [e["d"] * nudge * 1.02] * len(e["seed_gains_pct"]),  # just right of the bar
                e["seed_gains_pct"],
                ls="none",
                marker="o",
                ms=3.5,
                mfc="none",
                alpha=0.8,
                color=colors[head],
            )
    gain_ax.axhline(0.0, color="0.3", lw=1, ls="--", label="softmax")
    ax.set_ylabel("test perplexity (mean ± std over seeds)")
    ax.set_title(f"{config.trunk.data.corpus}: perplexity against the bottleneck width")
    gain_ax.set_ylabel("gain over softmax at the same d (%)")
    gain_ax.set_title(
        f"better than softmax above the line (bars: paired {1 - ALPHA:.0%} CI; circles: seeds)",
        fontsize=10,
    )
    for axis in (ax, gain_ax):
        axis.set_xscale("log", base=2)
        axis.set_xticks(list(config.ds), [str(d) for d in config.ds])
        axis.set_xlabel("d (head input width: the bottleneck)")
        axis.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _half_interval(e: dict[str, Any]) -> float:
    """Half the width of an entry's paired interval (0 without one), for an error bar."""
    return 0.0 if e["gain_ci"] is None else (e["gain_ci"][1] - e["gain_ci"][0]) / 2


# A line style per seed, in the order of ``config.seeds`` (repeating past four).
SEED_LINE_STYLES = ("-", "--", ":", "-.")


def _seed_line_style(config: Config, seed: int) -> str:
    return SEED_LINE_STYLES[config.seeds.index(seed) % len(SEED_LINE_STYLES)]


def plot_curves(curves: dict[tuple[str, int, int], list], config: Config, path: Path) -> None:
    fig, axes = plt.subplots(
        1, len(config.ds), figsize=(4.2 * len(config.ds), 3.8), squeeze=False, sharey=False
    )
    colors = {head: f"C{i}" for i, head in enumerate(config.heads)}
    for ax, d in zip(axes[0], config.ds, strict=True):
        ax.set_title(f"d = {d}")
        if not any(cd == d and curve for (_, cd, _), curve in curves.items()):
            ax.text(0.5, 0.5, "no cell finished yet", ha="center", va="center")
            ax.set_axis_off()
            continue
        for (head, cd, seed), curve in curves.items():
            if cd != d or not curve:
                continue
            ax.plot(
                [r["epoch"] for r in curve],
                [r["valid_ppl"] for r in curve],
                color=colors[head],
                ls=_seed_line_style(config, seed),
                marker=".",
                label=head if seed == config.seeds[0] else None,
            )
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            set_formatter(FormatStrFormatter("%g"))  # 6.2, not 6.2 x 10^0
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation perplexity")
    # Colour is the head, line style the seed: one legend entry each.
    seed_keys = [
        Line2D([], [], color="0.3", ls=_seed_line_style(config, seed), label=f"seed {seed}")
        for seed in config.seeds
    ]
    handles, _ = axes[0][0].get_legend_handles_labels()
    axes[0][0].legend(handles=handles + seed_keys, fontsize=8)
    fig.suptitle(f"{config.trunk.data.corpus}: learning curves")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def run_study(config: Config) -> dict[str, Any]:
    root = Path(config.out_dir)
    run = open_run(root, config, resume=True)
    start = time.perf_counter()
    rows, curves = [], {}
    results_csv = None if config.results_csv is None else Path(config.results_csv)
    recorded = {} if results_csv is None else read_results_csv(results_csv)
    cells = [(h, d, s) for s in config.seeds for d in config.ds for h in config.heads]
    device = accelerator()
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
        others = block_devices(config, recorded, d, seed) - {device}
        if others and not finished_before:
            print(
                f"=== cell {i + 1}/{len(cells)}: {name}: deferred: its block (d = {d}, seed "
                f"{seed}) trained on {', '.join(sorted(others))}, this machine is {device} ==="
            )
            rows.append({"head": head, "d": d, "seed": seed, "status": "pending"})
            continue
        print(f"\n=== cell {i + 1}/{len(cells)}: {name} ===", flush=True)
        began = cell_device(cell)
        if began not in (None, device):  # nothing of it is recorded: train it afresh here
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
            env = {**os.environ, "CELL": name, "RESULTS_CSV": str(results_csv or "")}
            subprocess.run(config.after_cell, shell=True, env=env, check=False)
    table = summarize(rows, config)
    ranks = rank_cells(config, run) if config.rank_d is not None else []
    study = {
        "corpus": config.trunk.data.corpus,
        "cells": rows,
        "summary": table,
        "ranks": ranks,
        "train_seconds_total": trained_seconds(rows),
        "seconds_this_invocation": time.perf_counter() - start,
    }
    run.write_json("study.json", study)
    run.write_csv("study.csv", rows)
    text = markdown(table, rows, config)
    if ranks:
        text += (
            f"\nRank of the test log-probability matrix at d = {config.rank_d} "
            f"({ranks[0]['rows_analysed']} tokens x {ranks[0]['columns_analysed']} words; d + 2 = "
            f"{config.rank_d + 2}):\n\n"
            + markdown_table(
                [
                    {
                        "head": r["head"],
                        "numerical rank": r["numerical_rank"],
                        "effective rank (99%)": r["effective_rank"],
                    }
                    for r in ranks
                ]
            )
            + "\n"
        )
    run.write_page("study.md", title(config, rows), text)
    plot_vs_d(table, config, run.path("test_ppl_vs_d.png"))
    plot_curves(curves, config, run.path("learning_curves.png"))
    print(markdown_table(table, ("d", "head", "test_ppl", "test_std", "gain_pct"), floatfmt=".2f"))
    failed = sum(r["status"] == "failed" for r in rows)
    print(
        f"\nwrote {root}/: study.json, study.csv, study.md, test_ppl_vs_d.png, "
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
