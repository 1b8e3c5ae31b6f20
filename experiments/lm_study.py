"""Perplexity against the bottleneck width d for every head, at convergence: a multi-seed study.

The seeds' central claim (Yang et al. 2018; Kanai et al. 2018; Ganea et al. 2019): a softmax over
``W h`` with ``h`` in R^d gives log-probability matrices of rank <= d + 1, so a head that breaks
the bottleneck (sigsoftmax, PLIF, MoS, Mixtape, ...) should lower perplexity, and most where d is
small. This script trains one language model per cell of the grid ``heads x ds x seeds`` with the
language model's own run loop (``experiments/language_model.py``, in-process) and tabulates it.

Model (a Transformer, by default). The trunk's blocks are the same and the head's input width
``d`` varies: every cell is ``--trunk``, a config of ``language_model.py`` (by default its preset
``transformer-study``: 2 pre-norm layers of width 128, AdamW with warmup and a cosine over the
budget; its flags, such as ``--data_dir`` or ``--epochs``, set every cell's), with the cell's
head, ``head_features d``, seed and folders replaced. The head reads ``h = P x``
(a learned ``128 -> d`` projection of the trunk's features), so a softmax head's log-probabilities
have rank <= d + 2 (with its output bias) whatever the trunk; the tied embedding is factorized
(ALBERT): a ``d``-wide table shared with the head's decoder, projected up to the trunk's width at
the input. Mixtures decode ``K`` latents of width ``d`` with the same tied table. That table sizes
the input embedding by ``d`` too, so the trunk's input and parameter count change with ``d``
(0.57 M parameters at d = 16, 1.72 M at d = 128): ``--embedding fixed`` keeps everything but the
head the same at every ``d`` instead, a ``d_model``-wide tied table ``E`` (the unfactorized
model's embedding) decoded by the head as ``E Q`` with a learned ``[d_model, d]`` map ``Q``
(``--embedding_features`` of ``language_model.py``; its digests differ from the factorized grid's,
so the two never mix in one results CSV).
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
improved validation by less than 0.5% in all. The best-validation model is evaluated. No head is
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

Writes to --out_dir: config.json; study.json / study.csv (one row per cell: valid / test
perplexity, epochs, stopping reason, convergence, seconds, parameters, the validation curve, the
code's commit), study.md (mean +- std per head x d and the gain over softmax, seed by seed),
test_ppl_vs_d.png (perplexity and the gain over softmax against d), learning_curves.png, and
for ``--rank_d`` the numerical / effective rank of each head's test log-probabilities
(``rank/<head>/``, via ``experiments/rank.py --mode model``; ``ranks`` in study.json).
"""

from __future__ import annotations

import experiments  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import csv
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import matplotlib
import numpy as np

from bottleneck.nn.presets import HeadName
from bottleneck.train import (
    DataConfig,
    EvaluationConfig,
    HeadConfig,
    OptimizerConfig,
    RunDir,
    RunFolderError,
    TrainingConfig,
    UsageError,
    markdown_table,
    open_run,
    parse_config,
)
from bottleneck.train.experiment import Checked, Count, one_line_errors
from bottleneck.train.run_folder import accelerator, check_resumable, code_commit, to_jsonable
from bottleneck.train.run_loop import TrainingDiverged
from experiments import language_model, rank
from experiments.language_model import AWDLSTMConfig, TransformerConfig

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FormatStrFormatter  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """A grid of language models: heads x bottleneck widths d x seeds, each trained to convergence."""

    #: every cell's language model (experiments/language_model.py's config: trunk, data,
    #: optimizer, schedule, budget); each cell sets its head, its width d, the seed and folders
    trunk: language_model.Config = language_model.PRESETS["transformer-study"]
    heads: tuple[HeadName, ...] = ("softmax", "sigsoftmax", "plif", "mos", "mixtape")
    ds: tuple[Count, ...] = (16, 32, 64, 128)  # bottleneck widths d (the head's input)
    #: a Transformer's tied embedding: factorized (a d-wide table projected up to the trunk,
    #: so the trunk's input changes with d; the grid of docs/results/) | fixed (the trunk's own
    #: --embedding_features-wide table, d_model by default, the head decoding with E Q: only
    #: the head changes with d)
    embedding: Literal["factorized", "fixed"] = "factorized"
    seeds: tuple[int, ...] = (1, 2, 3)
    rank_d: Count | None = 16  # d whose first seed's test log-probs are ranked; None: skip
    rank_tokens: Count = 4000  # test rows ranked
    rank_vocab: Count = 4000  # vocabulary columns ranked (a random subset if fewer)
    #: a CSV of finished cells kept apart from --out_dir (e.g. committed): each finished cell's
    #: row is merged into it at once, and a cell whose row there has the same config is not run
    #: again, even without its run folder
    results_csv: str | None = None
    #: a shell command run after each finished cell (its name in $CELL, the CSV in
    #: $RESULTS_CSV), e.g. to commit --results_csv
    after_cell: str | None = None
    #: tabulate and plot the cells recorded in --results_csv (or finished in --out_dir) without
    #: training the others, which are listed as pending
    report_only: bool = False
    out_dir: str = "runs/lm_study"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.report_only and self.results_csv is None:
            raise ValueError("report_only reads --results_csv: name the CSV of recorded cells")
        for name in ("heads", "ds", "seeds"):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{name} must name distinct values, at least one, got {values}")
        model = self.trunk.model
        if self.embedding == "fixed" and not isinstance(model, TransformerConfig):
            raise ValueError(
                f"embedding 'fixed' is a Transformer's (model:transformer), not {model.family}'s"
            )
        if (
            self.embedding == "factorized"
            and isinstance(model, TransformerConfig)
            and model.embedding_features is not None
        ):
            raise ValueError(
                f"embedding_features {model.embedding_features} fixes the trunk's embedding: "
                "give it with --embedding fixed"
            )
        if self.rank_d is not None and self.rank_d not in self.ds:
            raise ValueError(f"rank_d {self.rank_d} is not one of ds {self.ds}")
        for head in self.heads:  # the language model's own checks, for every cell, now
            cell_config(self, head, self.ds[0], self.seeds[0])


def cell_name(head: str, d: int, seed: int) -> str:
    return f"{head}-d{d}-s{seed}"


def cell_config(config: Config, head: str, d: int, seed: int) -> language_model.Config:
    """The language-model config of one cell: the trunk with this cell's head, width, seed and
    folder (the prepared corpus is shared); ``--embedding fixed``: the trunk's embedding
    ``embedding_features`` wide (``d_model`` unless set) at every ``d``."""
    root, trunk = Path(config.out_dir), config.trunk
    ranked = head in config.heads and d == config.rank_d and seed == config.seeds[0]
    model = trunk.model.with_head_width(d)
    if config.embedding == "fixed":
        model = replace(model, embedding_features=model.embedding_features or model.d_model)
    return replace(
        trunk,
        model=model,
        data=replace(trunk.data, tfds_dir=str(root / "tfds")),
        head=replace(trunk.head, name=head),
        evaluation=replace(
            trunk.evaluation,
            dynamic_eval=False,
            max_logprob_tokens=config.rank_tokens if ranked else 0,
        ),
        seed=seed,
        out_dir=str(root / "cells" / cell_name(head, d, seed)),
    )


# Seconds: the fixture corpus, a tiny Transformer, every stage (resume, rank, table, plots).
_SMOKE = dict(
    heads=("softmax", "mos"), ds=(4,), seeds=(1,), rank_d=4, rank_tokens=50, rank_vocab=50
)
# The AWD-LSTM's grid (the same protocol for every head): a 2-layer model of inner width 128,
# SGD with NT-ASGD.
_AWD = language_model.Config(
    model=AWDLSTMConfig(
        nhid=128, nlayers=2, dropout=0.1, dropouth=0.1, dropouti=0.1, dropoute=0.0, wdrop=0.1
    ),
    data=DataConfig(batch_size=64, eval_batch_size=64, bptt=35),
    head=HeadConfig(num_components=4, num_knots=10_000),
    optimizer=OptimizerConfig(lr=20.0, nonmono=1),
    training=TrainingConfig(epochs=13, patience=2),
    evaluation=EvaluationConfig(test_batch_size=64),
)
PRESETS: dict[str, Config] = {
    # The negative control: a vocabulary no wider than d, where no head has a rank bottleneck
    # (64 words incl. <unk> and <eos>, d = 64): the heads should tie within the seed spread.
    "control": Config(
        trunk=replace(Config.trunk, data=replace(Config.trunk.data, vocab_size=64)),
        ds=(64,),
        rank_d=64,
        rank_vocab=64,
    ),
    "smoke": Config(
        trunk=replace(
            language_model.PRESETS["transformer-smoke"],
            training=TrainingConfig(epochs=2, patience=1),
        ),
        **_SMOKE,
    ),
    # The same for the AWD-LSTM.
    "awd-smoke": Config(
        trunk=replace(
            _AWD,
            model=replace(_AWD.model, nhid=16),
            data=DataConfig(
                data_dir=str(language_model.FIXTURES_DIR),
                train_tokens=200,
                eval_tokens=100,
                batch_size=2,
                eval_batch_size=2,
                bptt=3,
            ),
            head=HeadConfig(num_components=2, num_knots=100),
            optimizer=OptimizerConfig(lr=1.0, nonmono=1),
            training=TrainingConfig(epochs=2, patience=2),
            evaluation=EvaluationConfig(test_batch_size=2),
        ),
        **_SMOKE,
    ),
    # The AWD-LSTM grid of docs/lm_study.md (2 epochs on a 2,000-word PTB: not converged).
    "awd-2epoch": Config(
        trunk=replace(
            _AWD,
            data=replace(_AWD.data, vocab_size=2000),
            head=replace(_AWD.head, num_components=3),
            training=TrainingConfig(epochs=2, patience=2),
        ),
        heads=("softmax", "sigsoftmax", "plif", "mos", "moss"),
        ds=(8, 16, 32),
        seeds=(1, 2),
        rank_d=8,
    ),
    # For a GPU: the AWD-LSTM at wider bottlenecks, three seeds, a longer budget.
    "awd-full": Config(
        trunk=replace(
            _AWD,
            model=replace(_AWD.model, nhid=512, nlayers=3),
            head=HeadConfig(num_components=8, num_knots=100_000),
            training=TrainingConfig(epochs=40, patience=3),
        ),
        heads=("softmax", "sigsoftmax", "plif", "mos", "moss", "mos_plif", "monotone_mlp"),
        ds=(16, 32, 64, 128, 256),
        rank_d=64,
        rank_tokens=20_000,
        rank_vocab=10_000,
    ),
}


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
    "valid_curve", "commit", "config_sha", "device",
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

    The config as ``config.json`` records it (:func:`~bottleneck.train.run_folder.to_jsonable`:
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
    }


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


def main_device(rows: list[dict[str, Any]]) -> str:
    """The device most finished cells trained on: the one whose seconds the report compares."""
    devices = [r["device"] for r in rows if r["status"] == "done"]
    return max(devices, key=devices.count, default="")


def summarize(rows: list[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """Mean +- std over seeds per head x d, and the gain over softmax at the same d; seconds
    (s/epoch, the cost over softmax) only of the cells trained on :func:`main_device`."""
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
    return table


def _paired_gains(cells: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The gain over softmax seed by seed, over the seeds where both finished (the heads of one
    seed share its data order and initial trunk): its mean in perplexity and in %, the per-seed
    gains in %, their spread (``None`` below two seeds) and how many seeds the head beats
    softmax in (``base``: softmax's rows at the same d, by seed). Empty if no seed has both.
    A seed of the head alone counts in its mean perplexity, not in its gain: compared with
    softmax's other seeds, the seeds' own spread would pass for a head's gain."""
    pairs = [(base[r["seed"]]["test_ppl"], r["test_ppl"]) for r in cells if r["seed"] in base]
    if not pairs:
        return {}
    gains = [100.0 * (softmax - ppl) / softmax for softmax, ppl in pairs]
    return {
        "gain_ppl": float(np.mean([softmax - ppl for softmax, ppl in pairs])),
        "gain_pct": float(np.mean(gains)),
        "seed_gains_pct": [float(g) for g in gains],
        "gain_pct_std": float(np.std(gains, ddof=1)) if len(gains) > 1 else None,
        "better_seeds": sum(g > 0 for g in gains),
        "paired_seeds": len(gains),
    }


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
    """The results page's body: the table of heads x d, then what each cell's row says."""
    trunk, decimals = config.trunk, _decimals(table)
    lines = [
        "Test perplexity of the best-validation model, mean ± std over seeds; gain = softmax's "
        "test perplexity minus the head's at the same d and seed (positive: better than "
        "softmax), averaged over the seeds where both finished (a head and softmax of one seed "
        "share its data order and initial trunk); its ± is the std of those per-seed gains, and "
        "'better in' counts the seeds in which the head beats softmax. "
        f"Budget {trunk.training.epochs} epochs per cell, early stopping with patience "
        f"{trunk.training.patience}; "
        "'stopped early' counts the seeds whose validation perplexity stopped improving before "
        "the budget ended; 'converged' those stopped early or whose last three epochs improved "
        f"validation by less than {100 * CONVERGED_IMPROVEMENT:g}% in all.",
        "",
        markdown_table([_table_row(e, decimals) for e in table]),
        "",
        "The same gains, a column per d (softmax's row: its test perplexity; the others': gain "
        "over softmax in %, ± the per-seed spread, and in how many paired seeds the head wins)",
    ]
    grid = gains_by_d(table, config, decimals)
    if grid and "published (PTB)" in grid[0]:
        lines[-1] += (
            ", and the head's published gain on PTB over the same table's softmax (test "
            "perplexity without finetuning): "
            + "; ".join(f"{head}: {r.source}" for head, r in PUBLISHED_PTB.items())
            + " (— where no PTB number is in this project's sources)"
        )
    lines[-1] += ":"
    lines += ["", markdown_table(grid)]
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
    done = [r for r in rows if r["status"] == "done"]
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
    then each head's paired gain over it ("—" where no seed is paired, blank where no cell); a
    head or d with no cell at all has no row or column. For a study of PTB's 10,000 words, a
    last column gives the head's published gain there (:data:`PUBLISHED_PTB`)."""
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
                text = f"{_gain_pct_text(e)}% ({_better_in_text(e)})"
            else:
                text = "—"
            cells[f"d = {d}"] = text
        if published:
            cells["published (PTB)"] = PUBLISHED_PTB[head].text() if head in PUBLISHED_PTB else "—"
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
    softmax's in the same table (``softmax_ppl`` is None for softmax's own row), and its
    seconds per epoch where the table gives them."""

    source: str
    head_ppl: float
    softmax_ppl: float | None = None
    seconds_per_epoch: float | None = None

    def text(self) -> str:
        if self.softmax_ppl is None:
            return f"{self.head_ppl:g}"
        return f"{100.0 * (self.softmax_ppl - self.head_ppl) / self.softmax_ppl:+.2f}%"

    def time_ratio_text(self, softmax: PublishedResult) -> str:
        """Its seconds per epoch over ``softmax``'s, as the cost grid writes it."""
        if self.seconds_per_epoch is None or softmax.seconds_per_epoch is None:
            return "—"
        return f"{self.seconds_per_epoch / softmax.seconds_per_epoch:.2f}×"


#: The seeds' claims, for the report's last column: each against the softmax of the same table
#: (AWD-LSTMs of 24-27 M parameters, d = 400, MoS's 280, trained for hundreds of epochs; ours
#: has 0.6-2.1 M); test perplexity before finetuning and dynamic evaluation. Mixtape's paper
#: (Yang et al. 2019) reports PTB, but its table is not among this project's sources.
PUBLISHED_PTB: dict[str, PublishedResult] = {
    "softmax": PublishedResult(
        "AWD-LSTM (Merity et al. 2017) as tabulated by Ganea et al. 2019, ~60 s per epoch",
        58.37,
        seconds_per_epoch=60.0,
    ),
    "sigsoftmax": PublishedResult(
        "Kanai et al. 2018, Table 4 (3-layer AWD-LSTM, mean of 10 runs: 58.8 → 58.4)", 58.4, 58.8
    ),
    "plif": PublishedResult(
        "Ganea et al. 2019 (10^5 knots: 58.37 → 57.25, ~70 s per epoch)",
        57.25,
        58.37,
        seconds_per_epoch=70.0,
    ),
    "mos": PublishedResult(
        "Yang et al. 2018 (K = 15) as tabulated by Ganea et al. 2019 (58.37 → 56.43, ~150 s per "
        "epoch)",
        56.43,
        58.37,
        seconds_per_epoch=150.0,
    ),
}


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
    a line per head, error bars the std over seeds (of the per-seed gains on the right, where
    each seed's gain is a hollow circle beside its bar). The heads sit slightly apart along d
    so that their error bars do not hide one another."""
    fig, (ax, gain_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {head: f"C{i}" for i, head in enumerate(config.heads)}
    for i, head in enumerate(config.heads):
        entries = [e for e in table if e["head"] == head]
        gains = [e for e in entries if "gain_pct" in e]
        # On the log2 axis a multiplicative nudge: the heads spread over about +-6% of d.
        nudge = 2.0 ** (0.16 * (i / max(len(config.heads) - 1, 1) - 0.5))
        for axis, rows, value, spread in (
            (ax, entries, "test_ppl", "test_std"),
            (gain_ax, gains, "gain_pct", "gain_pct_std"),
        ):
            if rows:
                axis.errorbar(
                    [e["d"] * nudge for e in rows],
                    [e[value] for e in rows],
                    yerr=[e[spread] or 0.0 for e in rows],
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
    gain_ax.set_title("better than softmax above the line (bars: ± std; circles: seeds)")
    for axis in (ax, gain_ax):
        axis.set_xscale("log", base=2)
        axis.set_xticks(list(config.ds), [str(d) for d in config.ds])
        axis.set_xlabel("d (head input width: the bottleneck)")
        axis.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        (row,) = rank.main(
            [
                "--mode", "model",
                "--log_probs", str(log_probs),
                "--hidden_size", str(config.rank_d),
                "--max_vocab", str(config.rank_vocab),
                "--max_tokens", str(config.rank_tokens),
                "--out_dir", str(run.root / "rank" / head),
            ]
        )  # fmt: skip
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
        print(f"\n=== cell {i + 1}/{len(cells)}: {name} ===", flush=True)
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
