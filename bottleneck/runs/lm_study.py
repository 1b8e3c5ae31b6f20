"""The study's grid of language models (``experiments/lm_study.py``): its config and presets, and
each cell's language model config (:func:`cell_config`).

A cell is one head at one bottleneck width ``d`` and one seed, trained by
:func:`bottleneck.runs.language_model.run_experiment` in ``OUT_DIR/cells/HEAD-dD-sSEED``; the
study runs, records and reports them (the script). Each finished cell is a row
(:func:`cell_row`) of the study's results CSV (:func:`read_results_csv`,
:func:`merge_results_csv`), keyed by head, d, seed and the digest of the cell's config
(:func:`config_sha`): a row with the same key is the same cell, wherever it was trained.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from bottleneck.data import FIXTURES_DIR
from bottleneck.nn.presets import HeadName
from bottleneck.runs import language_model
from bottleneck.runs import rows as store
from bottleneck.runs.cli import Checked, Count
from bottleneck.runs.folder import accelerator, code_commit, to_jsonable
from bottleneck.runs.language_model import AWDLSTMConfig, TransformerConfig
from bottleneck.runs.lm_config import (
    DataConfig,
    EvaluationConfig,
    HeadConfig,
    OptimizerConfig,
    TrainingConfig,
)


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """A grid of language models: heads x bottleneck widths d x seeds, each trained until the
    study's stopping rule ends it (early stopping, or the epoch budget)."""

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
    #: the report's tuned arm: results CSVs of this grid at one d under other peak learning
    #: rates and dropouts, one CSV a setting (--results_csv itself is the recipe's); each head
    #: takes the setting of its best validation at its first seed, and its seeds there are
    #: compared with softmax's at softmax's own choice
    tuned_csvs: tuple[str, ...] = ()
    #: the tuned arm's seeds: the first chooses each head's setting, all of them train at it
    #: (the report lists the arm's cells not recorded yet)
    tuned_seeds: tuple[int, ...] = (1, 2, 3)
    #: the report's convergence probe: a results CSV of cells trained with a longer budget
    #: (the same schedule's shape), each compared with this grid's cell of its head, d and seed
    probe_csv: str | None = None
    out_dir: str = "runs/lm_study"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.report_only and self.results_csv is None:
            raise ValueError("report_only reads --results_csv: name the CSV of recorded cells")
        for name in ("heads", "ds", "seeds", "tuned_seeds"):
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
    root = Path(config.out_dir)
    ranked = head in config.heads and d == config.rank_d and seed == config.seeds[0]
    cell = config.trunk.cell(
        head, d, out_dir=str(root / "cells" / cell_name(head, d, seed)),
        tfds_dir=str(root / "tfds"), seed=seed,
    )  # fmt: skip
    model = cell.model
    if config.embedding == "fixed":
        model = replace(model, embedding_features=model.embedding_features or model.d_model)
    evaluation = replace(
        cell.evaluation, dynamic_eval=False, max_logprob_tokens=config.rank_tokens if ranked else 0
    )
    return replace(cell, model=model, evaluation=evaluation)


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
    # It bounds what a head's optimisation does on frequent words; it removes the vocabulary's
    # tail, where the main grid's deficits are, so it bounds nothing there.
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
                data_dir=str(FIXTURES_DIR),
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
# A cell's row


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
    rows = {}
    for raw in store.read_csv(path):
        row: dict[str, Any] = dict(raw)
        for name in ("d", "seed", "epochs", "best_epoch", "params"):
            row[name] = int(row[name])
        for name in ("valid_ppl", "test_ppl", "seconds_per_epoch", "train_seconds"):
            row[name] = float(row[name])
        row["vocab_size"] = int(row["vocab_size"]) if row["vocab_size"] else None
        row["converged"] = row["converged"] == "True"
        row["status"] = "done"
        for name in ("lr", "dropout"):  # before these columns: None (the CSV's recipe)
            row[name] = float(row[name]) if row.get(name) else None
        rows[(row["head"], row["d"], row["seed"], row["config_sha"])] = row
    return rows


def _cell_key(row: dict[str, Any]) -> tuple[str, int, int]:
    return row["head"], row["d"], row["seed"]


def merge_results_csv(path: Path, row: dict[str, Any]) -> None:
    """Writes ``row`` into the CSV at ``path``, replacing the row of the same cell (atomically)."""
    kept = store.upsert(list(read_results_csv(path).values()), row, key=_cell_key)
    kept.sort(key=lambda r: (r["vocab_size"] or 0, r["d"], r["head"], r["seed"]))
    store.write_csv(path, kept, RESULT_COLUMNS)


def curve_from_row(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"epoch": i + 1, "valid_ppl": float(v)} for i, v in enumerate(row["valid_curve"].split())
    ]
