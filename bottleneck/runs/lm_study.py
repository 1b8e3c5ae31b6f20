"""The study's grid of language models (``experiments/lm_study.py``): its config and presets, and
each cell's language model config (:func:`cell_config`).

A cell is one head at one bottleneck width ``d`` and one seed, trained by
:func:`bottleneck.runs.language_model.run_experiment` in ``OUT_DIR/cells/HEAD-dD-sSEED``; the
study runs, records and reports them (the script).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Literal

from bottleneck.data import FIXTURES_DIR
from bottleneck.nn.presets import HeadName
from bottleneck.runs import language_model
from bottleneck.runs.cli import Checked, Count
from bottleneck.runs.language_model import AWDLSTMConfig, TransformerConfig
from bottleneck.train import (
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
    #: the report's convergence probe: a results CSV of cells trained with a longer budget
    #: (the same schedule's shape), each compared with this grid's cell of its head, d and seed
    probe_csv: str | None = None
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
