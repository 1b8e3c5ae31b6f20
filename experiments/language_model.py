"""Word-level language modelling on PTB / WikiText-2: AWD-LSTM or Transformer, any output head.

``--model awd_lstm`` (the default) is the recipe of Merity et al. (2017) as used by Kanai et al.
(2018, App. C.1) and Ganea et al. (2019): a 3-layer AWD-LSTM (weight drop, locked / embedding
dropout, tied embeddings, AR/TAR), SGD with per-batch learning rate ``lr * seq_len / bptt``,
gradient clipping, weight decay and NT-ASGD. ``--model transformer`` is a GPT-2-style decoder
(:class:`bottleneck.nn.Transformer`: pre-norm, RoPE, tied embeddings) trained with AdamW, linear
warmup and cosine decay (``--optimizer adamw``), keeping the best validated model; start from
its presets (``transformer-smoke``, ``transformer-cpu``, ``transformer-gpu``). Either model
takes any head (``--head``) of bottleneck.nn.HEAD_NAMES: softmax, sigsoftmax, the sigmoid /
ReLU normalizers, PLIF, the monotone MLP, MoS (Yang et al. 2018), MoSS, MoS + PLIF.

    python experiments/language_model.py --preset smoke --out_dir /tmp/lm       # seconds
    python experiments/language_model.py --preset transformer-cpu --head mos \\
        --data_dir PTB_DIR
    python experiments/language_model.py --preset cpu-small --data_dir PTB_DIR
    python experiments/language_model.py --preset paper-ptb --head sigsoftmax --out_dir runs/ptb
    python experiments/language_model.py --preset paper-ptb --head sigsoftmax \\
        --finetune_from runs/ptb --out_dir runs/ptb-finetune                      # Merity's finetune
    python experiments/language_model.py --preset mos-ptb --lr 25 --finetune_from runs/mos \\
        --out_dir runs/mos-finetune --dynamic_eval                                 # Yang's recipe

This file is configuration and wiring. Flags come in groups, one per part of :class:`Config`
(``--data.*``, ``--awd_lstm.*``, ``--transformer.*``, ``--head.*``, ``--optimizer.*``,
``--training.*``, ``--evaluation.*``), each also under its short name (``--lr`` is
``--optimizer.lr``) where that is unique (``tie_weights`` is not: ``--awd_lstm.tie_weights``,
``--transformer.tie_weights``); ``--help`` lists them and the flags each preset sets. Both
models see the same data: the AWD-LSTM's variable-length training windows (for the stateless
Transformer, window boundaries that move every epoch vary the context each token is trained
with; ``--max_len`` must cover the longest, and each step is scaled by ``seq_len / bptt`` for
AdamW as for SGD) and the same evaluation windows. The run (epochs, NT-ASGD,
``--finetune_from``'s averaging stage, ``--patience``, checkpoints every epoch and on SIGINT /
SIGTERM, resuming by rerunning the same command, the final and ``--dynamic_eval`` evaluation,
the files written to ``--out_dir``) is :mod:`bottleneck.train.run_loop`'s; its docstring says
what it does. A resumed run may change only the fields in ``RESUMABLE_CHANGES`` (for AdamW not
``--epochs``, which sets its schedule's length) and the other model's group.

``--mesh data=4,vocab=2`` (default: every device on ``data``) shards the batch (``--batch_size``
must divide) and splits the head's decoder, the tied embedding and the normalizers over
``vocab`` (:mod:`bottleneck.sharding`); results equal one device's to float32 round-off
(tests/test_sharding.py). The script runs in one process; a multi-host run would need
:func:`bottleneck.sharding.initialize_distributed` and an output folder that every host can
write (checkpoints are written by Orbax, each host its own shards), which nothing tests yet.
A checkpoint that cannot be written (a full disk) stops the run with a one-line error and exit
status 2, its partial folder deleted; rerunning the command resumes from the last complete one.
"""

from __future__ import annotations

import experiments  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import sys
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from bottleneck import nn
from bottleneck.data.tfds_builders import TokenizedCorpus
from bottleneck.nn import HEAD_NAMES
from bottleneck.nn.awd_lstm import AWDLSTM, AWDLSTMLanguageModel
from bottleneck.nn.transformer import (
    NORMS,
    POSITION_ENCODINGS,
    Transformer,
    TransformerLanguageModel,
)
from bottleneck.sharding import mesh_from_flag, require_data_divides, shard_model, use_mesh
from bottleneck.train import parse_config
from bottleneck.train.experiment import UsageError
from bottleneck.train.lm import LanguageModel, LanguageModelTrainer
from bottleneck.train.lm_config import (
    DataConfig,
    EvaluationConfig,
    HeadConfig,
    OptimizerConfig,
    TrainingConfig,
)
from bottleneck.train.run_loop import TrainingDiverged, open_session, train_and_evaluate

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "fixtures"
MODELS = ("awd_lstm", "transformer")


@dataclasses.dataclass(frozen=True)
class AWDLSTMConfig:
    """The AWD-LSTM (Merity et al. 2017; --model awd_lstm): sizes, dropouts, AR / TAR."""

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
class TransformerConfig:
    """The decoder-only Transformer (GPT-2 style; --model transformer): sizes, norm, dropouts."""

    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int | None = dataclasses.field(
        default=None, metadata={"help": "MLP hidden width; none: 4 x d_model"}
    )
    max_len: int = dataclasses.field(
        default=256,
        metadata={"help": "longest window: >= bptt + max_seq_len_delta rounded up to the bucket"},
    )
    position_encoding: str = dataclasses.field(
        default="rope", metadata={"help": " | ".join(POSITION_ENCODINGS)}
    )
    norm: str = dataclasses.field(default="rmsnorm", metadata={"help": " | ".join(NORMS)})
    embedding_dropout: float = 0.1
    residual_dropout: float = dataclasses.field(
        default=0.1, metadata={"help": "on each block's attention and MLP outputs"}
    )
    attention_dropout: float = dataclasses.field(
        default=0.1, metadata={"help": "on the attention weights"}
    )
    tie_weights: bool = True
    head_features: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "the head's input width d behind learned projections (the bottleneck, with "
            "the trunk unchanged; tied: a factorized d-wide embedding); none: d_model"
        },
    )

    def validate(self) -> None:
        if self.head_features is not None and self.head_features < 1:
            raise ValueError(f"head_features must be >= 1 or none, got {self.head_features}")
        for name in ("d_model", "num_layers", "num_heads", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"d_ff must be >= 1 or none, got {self.d_ff}")
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads {self.num_heads} must divide d_model {self.d_model}")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(
                f"position_encoding must be one of {', '.join(POSITION_ENCODINGS)}, got "
                f"{self.position_encoding!r}"
            )
        if self.position_encoding == "rope" and (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"rope needs an even head size d_model / num_heads, got "
                f"{self.d_model} / {self.num_heads}"
            )
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        for name in ("embedding_dropout", "residual_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Config:
    """AWD-LSTM or Transformer language model on PTB / WikiText-2 with any output head (defaults:
    AWD-LSTM paper-ptb)."""

    model: str = dataclasses.field(
        default="awd_lstm",
        metadata={
            "help": "awd_lstm | transformer (with --optimizer adamw or adam; presets "
            "transformer-smoke, transformer-cpu, transformer-gpu)"
        },
    )
    data: DataConfig = DataConfig()
    awd_lstm: AWDLSTMConfig = AWDLSTMConfig()
    transformer: TransformerConfig = TransformerConfig()
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
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.model == "awd_lstm":
            self._validate_awd_lstm()
        else:
            self._validate_transformer()
        require_data_divides(self.mesh, "batch_size", self.data.batch_size)

    def _validate_awd_lstm(self) -> None:
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

    def _validate_transformer(self) -> None:
        if self.optimizer.name == "sgd":
            # The defaults are the AWD-LSTM's (SGD at lr 30): no recipe for a Transformer.
            raise ValueError(
                "model transformer trains with --optimizer adamw (or adam), not sgd / NT-ASGD; "
                "start from --preset transformer-cpu, transformer-gpu or transformer-smoke"
            )
        longest = self.data.longest_window
        if self.evaluation.dynamic_eval:
            longest = max(longest, self.evaluation.dynamic_eval_segment)
        if self.transformer.max_len < longest:
            raise ValueError(
                f"max_len {self.transformer.max_len} must cover the longest window, {longest} "
                "steps (bptt + max_seq_len_delta rounded up to seq_len_bucket, or "
                "dynamic_eval_segment)"
            )

    @property
    def resumable_changes(self) -> tuple[str, ...]:
        """The fields a resumed run may change: ``RESUMABLE_CHANGES``, but ``training.epochs``
        when it sets the length of AdamW's schedule (no ``decay_epochs``), the group of the other model and the head
        options its head does not take."""
        fields = RESUMABLE_CHANGES
        if self.optimizer.name == "adamw" and self.optimizer.decay_epochs is None:
            fields = tuple(name for name in fields if name != "training.epochs")
        unused = tuple(f"head.{name}" for name in self.head.unused_fields())
        return (*fields, *(name for name in MODELS if name != self.model), *unused)


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
# Seconds on any corpus: on the fixtures the token caps change nothing (18 training tokens); with
# --data_dir pointing at real PTB the run reads a few hundred tokens of each split.
_SMOKE = {
    "data.data_dir": str(FIXTURES_DIR),
    "head.num_components": 2,
    "head.num_knots": 100,
    "data.batch_size": 2,
    "data.eval_batch_size": 1,
    "evaluation.test_batch_size": 1,
    "data.bptt": 3,
    "data.seq_len_std": 1.0,
    "data.min_seq_len": 2,
    "data.max_seq_len_delta": 2,
    "training.epochs": 3,
    "data.train_tokens": 200,
    "data.eval_tokens": 100,
    "evaluation.logprob_block_tokens": 4,
    "evaluation.dynamic_eval": True,
    "evaluation.dynamic_eval_segment": 3,
    "evaluation.dynamic_eval_batch_size": 2,
    "evaluation.dynamic_eval_max_batches": 2,
}
# The Transformer's optimizer (GPT-2 practice): AdamW, clipping at 1, decoupled weight decay 0.1
# of the matrices, linear warmup then cosine decay; mixtures with linear latents. PLIF's slopes
# follow the same schedule at the same rate: an Adam step is about the rate whatever the gradient's scale, so Ganea et al.'s 0.02
# (set beside the AWD-LSTM's SGD at 30) would move them 10-40 times as fast as the rest here.
_TRANSFORMER = {
    "model": "transformer",
    "optimizer.name": "adamw",
    "optimizer.clip": 1.0,
    "optimizer.weight_decay": 0.1,
    "optimizer.plif_lr": None,
    # Identity-initialised linear facets: tanh latents saturate behind a pre-norm trunk and cap
    # a mixture's logit spread (MoS 117 +- 34 against softmax's 57 with tanh; README).
    "head.latent": "linear",
}
# The 2-core CPU's Transformer: width 128, 4 heads, batch 32 x bptt 64 (its depth per preset).
_CPU_TRUNK = {
    "transformer.d_model": 128,
    "transformer.num_heads": 4,
    "transformer.d_ff": 512,
    "transformer.max_len": 128,
    "transformer.attention_dropout": 0.0,
    "data.batch_size": 32,
    "data.eval_batch_size": 16,
    "data.bptt": 64,
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
        **_SMOKE,
        "awd_lstm.emsize": 8,
        "awd_lstm.nhid": 16,
        "awd_lstm.nlayers": 2,
        "optimizer.lr": 1.0,
        "optimizer.nonmono": 1,
    },
    "transformer-smoke": {
        **_SMOKE,
        **_TRANSFORMER,
        "transformer.d_model": 8,
        "transformer.num_layers": 2,
        "transformer.num_heads": 2,
        "transformer.max_len": 8,
        "optimizer.lr": 0.03,
        "optimizer.warmup_steps": 2,
    },
    # Minutes per head on 2 CPU cores. Measured first (training steps alone, softmax, on a
    # slower, loaded machine): 2,600 tokens/s with PTB's 2,000 most frequent words (as
    # experiments/lm_study.py) against 1,500 with all 10,000, whose head is then half the step; so
    # 2,000 words and two epochs: 11-15 minutes per head there, under 4 on an idle Zen 5
    # (softmax, sigsoftmax, PLIF, MoS, three seeds; README.md).
    "transformer-cpu": {
        **_TRANSFORMER,
        "data.vocab_size": 2000,
        **_CPU_TRUNK,
        "transformer.num_layers": 4,
        "optimizer.lr": 2e-3,
        "optimizer.warmup_steps": 100,
        "training.epochs": 2,
        "head.num_components": 3,
        "head.num_knots": 10_000,
        "evaluation.test_batch_size": 1,
        "evaluation.max_logprob_tokens": 10_000,
        "evaluation.dynamic_eval_segment": 64,
        "evaluation.dynamic_eval_max_batches": 50,
    },
    # The trunk and schedule of experiments/lm_study.py's converged grid (docs/lm_study.md has
    # the pilot that chose them): all of PTB's 10,000 words, the head at its own width d
    # (--head_features, set by each cell) behind a 2-layer trunk; a cosine over 10 epochs to 1% of
    # the peak rate, then three epochs at that rate, so that a cell ends when validation stops
    # improving (early stopping) or has improved less than 0.5% in those three epochs.
    "transformer-study": {
        **_TRANSFORMER,
        **_CPU_TRUNK,
        "transformer.num_layers": 2,
        "optimizer.lr": 3e-3,
        "optimizer.warmup_steps": 200,
        "optimizer.decay_epochs": 10,
        "optimizer.final_lr_fraction": 0.01,
        "training.epochs": 13,
        "training.patience": 1,
        "head.num_components": 4,
        "head.num_knots": 10_000,
        "evaluation.test_batch_size": 1,
        "evaluation.max_logprob_tokens": 0,
    },
    # A GPU-sized starting point (not run here, not tuned): GPT-2-small-like width, strong
    # dropout (PTB's million training tokens are few for 20M parameters), early stopping.
    "transformer-gpu": {
        **_TRANSFORMER,
        "transformer.d_model": 512,
        "transformer.num_layers": 6,
        "transformer.num_heads": 8,
        "transformer.d_ff": 2048,
        "transformer.max_len": 256,
        "transformer.embedding_dropout": 0.3,
        "transformer.residual_dropout": 0.3,
        "data.batch_size": 32,
        "data.bptt": 128,
        "data.max_seq_len_delta": 32,
        "data.eval_batch_size": 16,
        "optimizer.lr": 5e-4,
        "optimizer.warmup_steps": 1000,
        "training.epochs": 100,
        "training.patience": 10,
        "evaluation.test_batch_size": 1,
        "evaluation.max_logprob_tokens": 40_000,
        "evaluation.dynamic_eval_segment": 128,
    },
}


# Fields that may differ when a run is resumed: they change neither the model nor its training.
RESUMABLE_CHANGES = (
    "training.epochs", "data.data_dir", "data.tfds_dir", "data.seq_len_bucket", "awd_lstm.unroll",
    "evaluation", "out_dir",
)  # fmt: skip


def build_model(config: Config, vocab_size: int) -> LanguageModel:
    """The configured model with its head behind the run loop's interface, initialised from
    ``config.seed`` (build it under the run's mesh)."""
    rngs = nnx.Rngs(config.seed)
    head = {"head": config.head.name, **config.head.options()}
    if config.model == "transformer":
        options = dataclasses.asdict(config.transformer)
        return TransformerLanguageModel(Transformer(vocab_size, rngs=rngs, **options, **head))
    options = dataclasses.asdict(config.awd_lstm)
    alpha, beta = options.pop("alpha"), options.pop("beta")
    return AWDLSTMLanguageModel(
        AWDLSTM(vocab_size, rngs=rngs, **options, **head), alpha=alpha, beta=beta
    )


def build_trainer(
    config: Config, corpus: TokenizedCorpus, mesh: Mesh | None
) -> LanguageModelTrainer:
    """The model and its optimizer, placed on ``mesh`` (call it under the mesh)."""
    model = build_model(config, len(corpus.vocabulary))
    if mesh is not None:
        model = shard_model(model, mesh)
    epochs = config.optimizer.decay_epochs or config.training.epochs
    steps = epochs * config.data.steps_per_epoch(corpus.train, config.seed)
    return LanguageModelTrainer(
        model,
        config.optimizer.transformation(plif=config.head.uses_plif, total_steps=steps),
        seed=config.seed,
        mesh=mesh,
    )


def run_experiment(config: Config) -> dict[str, Any]:
    """Trains (or resumes, or finetunes) and evaluates; returns the results."""
    mesh = mesh_from_flag(config.mesh)
    # The mesh comes from context, as in Flax: the model is built and traced under it.
    with (
        open_session(config.out_dir, config, may_change=config.resumable_changes) as session,
        use_mesh(mesh),
    ):
        corpus = config.data.load(config.out_dir)
        return train_and_evaluate(
            build_trainer(config, corpus, mesh),
            corpus,
            session,
            data=config.data,
            training=config.training,
            evaluation=config.evaluation,
            policy=config.optimizer.policy(finetune=config.training.finetune_from is not None),
            seed=config.seed,
            describe={
                "model": config.model,
                "head": config.head.name,
                "corpus": config.data.corpus,
            },
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
