"""Word-level language modelling on PTB / WikiText-2: AWD-LSTM with any output head.

The recipe of Merity et al. (2017) as used by Kanai et al. (2018, App. C.1) and Ganea et al.
(2019): a 3-layer AWD-LSTM (weight drop, locked / embedding dropout, tied embeddings, AR/TAR),
SGD with per-batch learning rate ``lr * seq_len / bptt``, gradient clipping, weight decay and
NT-ASGD; the head (``--head``) is any of bottleneck.nn.HEAD_NAMES: softmax, sigsoftmax, the
sigmoid / ReLU normalizers, PLIF, the monotone MLP, MoS (Yang et al. 2018), MoSS, MoS + PLIF.

    python experiments/language_model.py --preset smoke --out_dir /tmp/lm       # seconds
    python experiments/language_model.py --preset cpu-small --data_dir ../shared/data
    python experiments/language_model.py --preset paper-ptb --head sigsoftmax --out_dir runs/ptb
    python experiments/language_model.py --preset paper-ptb --head sigsoftmax \\
        --finetune_from runs/ptb --out_dir runs/ptb-finetune                      # Merity's finetune
    python experiments/language_model.py --preset mos-ptb --lr 25 --finetune_from runs/mos \\
        --out_dir runs/mos-finetune --dynamic_eval                                 # Yang's recipe

This file is configuration and wiring. Flags come in groups, one per part of :class:`Config`
(``--data.*``, ``--awd_lstm.*``, ``--head.*``, ``--optimizer.*``, ``--training.*``,
``--evaluation.*``), each also under its short name (``--lr`` is ``--optimizer.lr``); ``--help``
lists them and the flags each preset sets. The run (epochs, NT-ASGD, ``--finetune_from``'s
averaging stage, ``--patience``, checkpoints every epoch and on SIGINT / SIGTERM, resuming by
rerunning the same command, the final and ``--dynamic_eval`` evaluation, the files written to
``--out_dir``) is :mod:`bottleneck.train.run_loop`'s; its docstring says what it does. A resumed
run may change only the fields in ``RESUMABLE_CHANGES``.

``--mesh data=4,vocab=2`` (default: every device on ``data``) shards the batch (``--batch_size``
must divide) and splits the head's decoder, the tied embedding and the normalizers over
``vocab`` (:mod:`bottleneck.sharding`); results equal one device's to float32 round-off
(tests/test_sharding.py). The script runs in one process; multi-host runs would need
:func:`bottleneck.sharding.initialize_distributed` and host-local checkpointing.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from bottleneck import nn
from bottleneck.nn import HEAD_NAMES
from bottleneck.nn.awd_lstm import AWDLSTM, AWDLSTMLanguageModel
from bottleneck.sharding import mesh_from_flag, require_data_divides, shard_model, use_mesh
from bottleneck.train import parse_config
from bottleneck.train.experiment import UsageError
from bottleneck.train.lm import LanguageModelTrainer
from bottleneck.train.lm_config import (
    DataConfig,
    EvaluationConfig,
    HeadConfig,
    OptimizerConfig,
    TrainingConfig,
)
from bottleneck.train.run_loop import TrainingDiverged, open_session, train_and_evaluate

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "fixtures"


@dataclasses.dataclass(frozen=True)
class AWDLSTMConfig:
    """The AWD-LSTM (Merity et al. 2017): sizes, dropouts, AR / TAR."""

    emsize: int = 400
    nhid: int = 1150
    nhidlast: int | None = dataclasses.field(
        default=None, metadata={"help": "last LSTM layer's size; none: emsize (needed for tying)"}
    )
    nlayers: int = 3
    tie_weights: bool = True
    dropout: float = 0.4
    dropouth: float = 0.25
    dropouti: float = 0.4
    dropoute: float = 0.1
    wdrop: float = 0.5
    dropoutl: float = dataclasses.field(default=0.0, metadata={"help": "mixture-latent dropout"})
    alpha: float = dataclasses.field(default=2.0, metadata={"help": "AR scale"})
    beta: float = dataclasses.field(default=1.0, metadata={"help": "TAR scale"})
    unroll: int = dataclasses.field(default=1, metadata={"help": "LSTM scan unroll factor"})

    def validate(self) -> None:
        for name in ("emsize", "nhid", "nlayers", "unroll"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.nhidlast is not None and self.nhidlast < 1:
            raise ValueError(f"nhidlast must be >= 1 or none, got {self.nhidlast}")
        for name in ("dropout", "dropouth", "dropouti", "dropoute", "wdrop", "dropoutl"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("alpha", "beta"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Config:
    """AWD-LSTM language model on PTB / WikiText-2 with any output head (defaults: paper-ptb)."""

    data: DataConfig = DataConfig()
    awd_lstm: AWDLSTMConfig = AWDLSTMConfig()
    head: HeadConfig = HeadConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    seed: int = 141
    mesh: str = dataclasses.field(
        default="",
        metadata={"help": "device mesh, e.g. data=4,vocab=2; empty: all devices on data"},
    )
    out_dir: str = "runs/language_model"

    def validate(self) -> None:
        """How the parts fit (each part checks itself)."""
        model, head = self.awd_lstm, self.head.name
        mixtures = [name for name in HEAD_NAMES if nn.is_mixture_preset(name)]
        if model.dropoutl > 0 and head not in mixtures:
            raise ValueError(f"dropoutl > 0 needs a mixture head ({', '.join(mixtures)})")
        if model.tie_weights and head not in mixtures:
            if model.nhidlast not in (None, model.emsize):
                raise ValueError(
                    f"tie_weights with head {head!r} needs nhidlast == emsize ({model.emsize}), "
                    f"got {model.nhidlast}"
                )
        require_data_divides(self.mesh, "batch_size", self.data.batch_size)


# Sources. Kanai et al. 2018 (the seeds' 003), App. C.1.1, for AWD-LSTM: emsize 400, nhid 1150,
# U(-0.1, 0.1) embedding and U(-1/sqrt(H), 1/sqrt(H)) LSTM init, NT-ASGD with lr 30, clip 0.25,
# dropouts (dropouti, dropouth, dropout, dropoute) = (0.4, 0.25, 0.4, 0.1) PTB and
# (0.65, 0.2, 0.4, 0.1) WT2, batch 20 PTB / 80 WT2, 1000 / 1500 epochs (twice Merity's 500 / 750),
# bptt N(70, 5) w.p. 0.95 else N(35, 5), AR 2 and TAR 1; dynamic evaluation lr in [3e-5, 1e-4],
# lambda in [1e-3, 5e-3], eps 1e-3, statistics batch 100. Not stated there, from AWD-LSTM's
# main.py / README: wdrop 0.5, weight decay 1.2e-6, nonmono 5, eval / test batch 10 / 1,
# seeds 141 (PTB) and 1882 (WT2). Ganea et al.'s slides (001): ~60 s/epoch and test 58.4 w/o
# finetune on PTB.
# MoS: the zihangdai/mos README commands (PyTorch 0.4 version): PTB emsize 280, nhid 960,
# nhidlast 620, K 15, dropouti 0.4, dropouth 0.225, dropoutl 0.29, lr 20 (finetune 25), batch 12,
# 1000 epochs, seed 28; WT2 emsize 300, nhid 1150, nhidlast 650, dropouti 0.55, dropouth 0.2,
# dropoutl 0.29, lr 15 (finetune 20), batch 15, max_seq_len_delta 20, 1000 epochs, seed 1882;
# defaults dropout 0.4, dropoute 0.1, wdrop 0.5, max_seq_len_delta 40; dynamiceval.py lr 0.002,
# eps 0.001 (WT2 0.002), lambda 0.075 (PTB) / 0.02 (WT2), sum-of-squares statistics.
# Kanai's App. C.1.2 quotes Yang et al.'s paper instead (PTB embedding V-dropout 0.55, hidden
# 0.225, word 0.10, weight 0.5, context 0.30; WT2 embedding 0.40, hidden 0.225); we follow the
# released code's commands, which reproduce the published numbers.
_AWD_WT2 = {
    "data.corpus": "wikitext2",
    "awd_lstm.dropouti": 0.65,
    "awd_lstm.dropouth": 0.2,
    "data.batch_size": 80,
    "training.epochs": 1500,
    "seed": 1882,
    # Full test log-probs would be 245,569 x 33,278 float32 = 33 GB; 40k rows are 5.3 GB.
    "evaluation.max_logprob_tokens": 40_000,
}
_MOS = {
    "head.name": "mos",
    "head.num_components": 15,
    "evaluation.dynamic_eval_style": "yang",
    "evaluation.dynamic_eval_lr": 0.002,
    "evaluation.dynamic_eval_epsilon": 0.001,
}
PRESETS: dict[str, dict[str, Any]] = {
    "paper-ptb": {},
    "paper-wt2": _AWD_WT2,
    "mos-ptb": {
        **_MOS,
        "awd_lstm.emsize": 280,
        "awd_lstm.nhid": 960,
        "awd_lstm.nhidlast": 620,
        "awd_lstm.dropouti": 0.4,
        "awd_lstm.dropouth": 0.225,
        "awd_lstm.dropoutl": 0.29,
        "optimizer.lr": 20.0,
        "data.batch_size": 12,
        "data.max_seq_len_delta": 40,
        "seed": 28,
        "evaluation.dynamic_eval_lambda": 0.075,
    },
    "mos-wt2": {
        **_MOS,
        "data.corpus": "wikitext2",
        "awd_lstm.emsize": 300,
        "awd_lstm.nhid": 1150,
        "awd_lstm.nhidlast": 650,
        "awd_lstm.dropouti": 0.55,
        "awd_lstm.dropouth": 0.2,
        "awd_lstm.dropoutl": 0.29,
        "optimizer.lr": 15.0,
        "data.batch_size": 15,
        "seed": 1882,
        "evaluation.max_logprob_tokens": 40_000,
        "evaluation.dynamic_eval_lambda": 0.02,
        "evaluation.dynamic_eval_epsilon": 0.002,
    },
    # One PTB epoch in under 5 minutes on 2 CPU cores (see the measurements in results.json /
    # metrics.jsonl "seconds"): a smaller AWD-LSTM with the same regularisers.
    "cpu-small": {
        "awd_lstm.emsize": 128,
        "awd_lstm.nhid": 256,
        "data.bptt": 35,
        "data.batch_size": 64,
        "awd_lstm.dropout": 0.3,
        "awd_lstm.dropouth": 0.2,
        "awd_lstm.dropouti": 0.3,
        "awd_lstm.dropoute": 0.05,
        "awd_lstm.wdrop": 0.3,
        "training.epochs": 30,
        "data.eval_batch_size": 64,
        "evaluation.test_batch_size": 1,
        "evaluation.max_logprob_tokens": 10_000,
        "evaluation.dynamic_eval_max_batches": 200,
    },
    # Seconds: the fixture corpus (18 training tokens), a 2-layer model, every stage.
    "smoke": {
        "data.data_dir": str(FIXTURES_DIR),
        "awd_lstm.emsize": 8,
        "awd_lstm.nhid": 16,
        "awd_lstm.nlayers": 2,
        "head.num_components": 2,
        "head.num_knots": 100,
        "data.batch_size": 2,
        "data.eval_batch_size": 1,
        "evaluation.test_batch_size": 1,
        "data.bptt": 3,
        "data.seq_len_std": 1.0,
        "data.min_seq_len": 2,
        "data.max_seq_len_delta": 2,
        "optimizer.lr": 1.0,
        "training.epochs": 3,
        "optimizer.nonmono": 1,
        # Seconds on any corpus: on the fixtures these caps change nothing (18 training tokens);
        # with --data_dir pointing at real PTB the run reads a few hundred tokens of each split.
        "data.train_tokens": 200,
        "data.eval_tokens": 100,
        "evaluation.logprob_block_tokens": 4,
        "evaluation.dynamic_eval": True,
        "evaluation.dynamic_eval_segment": 3,
        "evaluation.dynamic_eval_batch_size": 2,
        "evaluation.dynamic_eval_max_batches": 2,
    },
}


# Fields that may differ when a run is resumed: they change neither the model nor its training.
RESUMABLE_CHANGES = (
    "training.epochs", "data.data_dir", "data.tfds_dir", "data.seq_len_bucket", "awd_lstm.unroll",
    "evaluation", "out_dir",
)  # fmt: skip


def build_trainer(config: Config, vocab_size: int, mesh: Mesh | None) -> LanguageModelTrainer:
    """The AWD-LSTM with its head and optimizer, placed on ``mesh`` (call it under the mesh)."""
    options = dataclasses.asdict(config.awd_lstm)
    alpha, beta = options.pop("alpha"), options.pop("beta")
    model = AWDLSTM(
        vocab_size,
        head=config.head.name,
        rngs=nnx.Rngs(config.seed),
        **options,
        **config.head.options(),
    )
    if mesh is not None:
        model = shard_model(model, mesh)
    return LanguageModelTrainer(
        AWDLSTMLanguageModel(model, alpha=alpha, beta=beta),
        config.optimizer.transformation(plif=config.head.uses_plif),
        seed=config.seed,
        mesh=mesh,
    )


def run_experiment(config: Config) -> dict[str, Any]:
    """Trains (or resumes, or finetunes) and evaluates; returns the results."""
    mesh = mesh_from_flag(config.mesh)
    # The mesh comes from context, as in Flax: the model is built and traced under it.
    with (
        open_session(config.out_dir, config, may_change=RESUMABLE_CHANGES) as session,
        use_mesh(mesh),
    ):
        corpus = config.data.load(config.out_dir)
        return train_and_evaluate(
            build_trainer(config, len(corpus.vocabulary), mesh),
            corpus,
            session,
            data=config.data,
            training=config.training,
            evaluation=config.evaluation,
            policy=config.optimizer.policy(finetune=config.training.finetune_from is not None),
            seed=config.seed,
            describe={"model": "awd_lstm", "head": config.head.name, "corpus": config.data.corpus},
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_config(Config, PRESETS, argv)
    try:
        return run_experiment(config)
    except UsageError as err:
        print(f"language_model.py: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except TrainingDiverged as err:
        print(f"language_model.py: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
