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

Stages. Training runs ``--epochs`` epochs, switching from SGD to averaged SGD when the validation
loss has not improved for ``--nonmono`` epochs; from then on the average is evaluated and kept
as the best model. ``--finetune_from RUN_DIR`` is the finetune stage: it starts from that run's
best model, averages from the first step and stops when the same criterion fires (or after
``--epochs``). The final evaluation uses the best model: validation and test perplexity, the
test log-probabilities for ``experiments/rank.py --mode model`` and, with ``--dynamic_eval``,
dynamic evaluation (Krause et al.; Yang et al.'s variant with ``--dynamic_eval_style yang``).

Resuming. A checkpoint is written at the end of every epoch, and on SIGINT / SIGTERM after the
current step (then the run exits with status 128 + signal). Rerunning the same command resumes
from the latest checkpoint: parameters, optimizer state, NT-ASGD average and status, epoch and
position in it, best model, validation history and the recurrent state; dropout masks and window
lengths are functions of (seed, epoch, step), so a resumed run continues as if never stopped.
Flags that change the model or the training (anything but --epochs, data / output paths,
--test_batch_size and the final-evaluation options) must stay the same; the run refuses otherwise.
One process at a time may use an --out_dir (``out_dir/.lock``; a lock left by a killed run is
taken over).

Writes to --out_dir: config.json, metrics.jsonl (one line per epoch: train loss, validation
perplexity, seconds, tokens/s; a final "test" line), results.json, log_probs/block_*.npy (test
log-probabilities [T_i, M], float32, one row per test token in evaluation order: window, time
step, sequence), log_prob_targets.npy (the row's target ids) and checkpoints/.
Set JAX_COMPILATION_CACHE_DIR to reuse compiled steps across runs.

Many devices. ``--mesh data=4,vocab=2`` (default: every device on ``data``) shards the batch
(``--batch_size`` must divide) and splits the head's decoder, the tied embedding and the
normalizers over ``vocab`` (:mod:`bottleneck.sharding`); results equal one device's to float32
round-off (tests/test_sharding.py). The script runs in one process (all its local devices);
multi-host runs need the library's :func:`bottleneck.sharding.initialize_distributed` path and
host-local checkpointing, which this script does not do.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from bottleneck import nn
from bottleneck.data import CORPORA, batchify, bptt_windows, limit_vocabulary, load_corpus
from bottleneck.data.tfds_builders import TokenizedCorpus
from bottleneck.nn import HEAD_NAMES
from bottleneck.nn.awd_lstm import AWDLSTM, MIXTURE_HEAD_NAMES, AWDLSTMLanguageModel
from bottleneck.sharding import mesh_from_flag, require_data_divides, shard_model
from bottleneck.train import (
    RunFolderError,
    check_run_folder,
    make_optimizer,
    open_run,
    parse_config,
    print_table,
    progress,
)
from bottleneck.train.checkpoint import CheckpointStore, RunFolderBusy, RunLock, StopSignals
from bottleneck.train.dynamic_eval import STYLES
from bottleneck.train.experiment import RunDir, to_jsonable
from bottleneck.train.lm import (
    LanguageModelTrainer,
    LogProbBlockWriter,
    eval_windows,
    num_eval_windows,
    pad_window,
    padded_length,
)
from bottleneck.train.nt_asgd import NtAsgdStatus, end_of_epoch

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "fixtures"


@dataclasses.dataclass(frozen=True)
class Config:
    """AWD-LSTM language model on PTB / WikiText-2 with any output head (defaults: paper-ptb)."""

    # data
    corpus: str = dataclasses.field(default="ptb", metadata={"help": "ptb | wikitext2"})
    data_dir: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "folder with the release files (or its parent); none: $BOTTLENECK_DATA_DIR"
        },
    )
    tfds_dir: str | None = dataclasses.field(
        default=None, metadata={"help": "where TFDS prepares the corpus; none: OUT_DIR/tfds"}
    )
    vocab_size: int | None = dataclasses.field(
        default=None,
        metadata={"help": "keep the N most frequent training words, the others become <unk>"},
    )
    train_tokens: int | None = dataclasses.field(
        default=None, metadata={"help": "train on the first N training tokens only; none: all"}
    )
    eval_tokens: int | None = dataclasses.field(
        default=None,
        metadata={"help": "validate / test on the first N tokens of each split only; none: all"},
    )
    # model
    head: str = dataclasses.field(
        default="softmax", metadata={"help": "one of " + ", ".join(HEAD_NAMES)}
    )
    emsize: int = 400
    nhid: int = 1150
    nhidlast: int | None = dataclasses.field(
        default=None, metadata={"help": "last LSTM layer's size; none: emsize (needed for tying)"}
    )
    nlayers: int = 3
    num_components: int = dataclasses.field(
        default=15, metadata={"help": "K of mos / moss / mos_plif"}
    )
    num_knots: int = dataclasses.field(default=100_000, metadata={"help": "PLIF knots"})
    plif_bound: float = 20.0
    plif_noise: float = 0.0
    num_hidden: int = dataclasses.field(default=16, metadata={"help": "monotone_mlp width"})
    tie_weights: bool = True
    dropout: float = 0.4
    dropouth: float = 0.25
    dropouti: float = 0.4
    dropoute: float = 0.1
    wdrop: float = 0.5
    dropoutl: float = dataclasses.field(default=0.0, metadata={"help": "mixture-latent dropout"})
    unroll: int = dataclasses.field(default=1, metadata={"help": "LSTM scan unroll factor"})
    # optimisation
    optimizer: str = dataclasses.field(default="sgd", metadata={"help": "sgd (NT-ASGD) | adam"})
    lr: float = 30.0
    plif_lr: float | None = dataclasses.field(
        default=0.02, metadata={"help": "PLIF slopes' own learning rate (Ganea et al.); none: --lr"}
    )
    clip: float = dataclasses.field(default=0.25, metadata={"help": "global-norm clip; 0: off"})
    weight_decay: float = 1.2e-6
    alpha: float = dataclasses.field(default=2.0, metadata={"help": "AR scale"})
    beta: float = dataclasses.field(default=1.0, metadata={"help": "TAR scale"})
    batch_size: int = 20
    eval_batch_size: int = 10
    test_batch_size: int = 1
    bptt: int = 70
    seq_len_std: float = 5.0
    min_seq_len: int = 5
    max_seq_len_delta: int = 20
    seq_len_bucket: int = dataclasses.field(
        default=8, metadata={"help": "windows are padded to multiples of this (fewer compiles)"}
    )
    epochs: int = 1000
    nonmono: int = 5
    patience: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "early stopping: stop when validation has not improved for N epochs; none: off"
        },
    )
    finetune_from: str | None = dataclasses.field(
        default=None, metadata={"help": "run folder whose best model to finetune with ASGD"}
    )
    seed: int = 141
    # final evaluation
    max_logprob_tokens: int | None = dataclasses.field(
        default=None, metadata={"help": "test rows of log-probs to write; none: all, 0: none"}
    )
    logprob_block_tokens: int = dataclasses.field(default=4096, metadata={"help": "rows per .npy"})
    dynamic_eval: bool = False
    dynamic_eval_style: str = dataclasses.field(
        default="krause", metadata={"help": "krause | yang"}
    )
    dynamic_eval_lr: float = 5e-5
    dynamic_eval_lambda: float = 0.002
    dynamic_eval_epsilon: float = 0.001
    dynamic_eval_segment: int = dataclasses.field(default=5, metadata={"help": "tokens per update"})
    dynamic_eval_batch_size: int = dataclasses.field(
        default=100, metadata={"help": "batch of the training-gradient statistics"}
    )
    dynamic_eval_max_batches: int | None = dataclasses.field(
        default=None, metadata={"help": "training batches for the statistics; none: one epoch"}
    )
    mesh: str = dataclasses.field(
        default="",
        metadata={"help": "device mesh, e.g. data=4,vocab=2; empty: all devices on data"},
    )
    out_dir: str = "runs/language_model"

    def validate(self) -> None:
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {', '.join(CORPORA)}, got {self.corpus!r}")
        if self.head not in HEAD_NAMES:
            raise ValueError(f"unknown head {self.head!r}; choose one of {', '.join(HEAD_NAMES)}")
        positive = (
            "emsize", "nhid", "nlayers", "num_components", "num_knots", "num_hidden", "unroll",
            "batch_size", "eval_batch_size", "test_batch_size", "bptt", "min_seq_len",
            "seq_len_bucket", "epochs", "nonmono", "logprob_block_tokens",
            "dynamic_eval_segment", "dynamic_eval_batch_size",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 or none, got {self.vocab_size}")
        for name in ("nhidlast", "train_tokens", "eval_tokens", "patience"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or none, got {getattr(self, name)}")
        for name in ("dropout", "dropouth", "dropouti", "dropoute", "wdrop", "dropoutl"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        mixture = self.head in MIXTURE_HEAD_NAMES
        if self.dropoutl > 0 and not mixture:
            raise ValueError(f"dropoutl > 0 needs a mixture head ({', '.join(MIXTURE_HEAD_NAMES)})")
        if self.tie_weights and not mixture and self.nhidlast not in (None, self.emsize):
            raise ValueError(
                f"tie_weights with head {self.head!r} needs nhidlast == emsize ({self.emsize}), "
                f"got {self.nhidlast}"
            )
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be sgd or adam, got {self.optimizer!r}")
        if self.dynamic_eval_style not in STYLES:
            raise ValueError(
                f"dynamic_eval_style must be one of {STYLES}, got {self.dynamic_eval_style!r}"
            )
        for name in ("lr", "dynamic_eval_lr", "dynamic_eval_lambda", "dynamic_eval_epsilon"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.plif_lr is not None and self.plif_lr <= 0:
            raise ValueError(f"plif_lr must be > 0 or none, got {self.plif_lr}")
        for name in ("clip", "weight_decay", "alpha", "beta", "seq_len_std", "max_seq_len_delta"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_logprob_tokens is not None and self.max_logprob_tokens < 0:
            raise ValueError(
                f"max_logprob_tokens must be >= 0 or none, got {self.max_logprob_tokens}"
            )
        require_data_divides(self.mesh, "batch_size", self.batch_size)
        if self.dynamic_eval_max_batches is not None and self.dynamic_eval_max_batches < 1:
            raise ValueError(
                f"dynamic_eval_max_batches must be >= 1 or none, got {self.dynamic_eval_max_batches}"
            )


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
    "corpus": "wikitext2",
    "dropouti": 0.65,
    "dropouth": 0.2,
    "batch_size": 80,
    "epochs": 1500,
    "seed": 1882,
    # Full test log-probs would be 245,569 x 33,278 float32 = 33 GB; 40k rows are 5.3 GB.
    "max_logprob_tokens": 40_000,
}
_MOS = {
    "head": "mos",
    "num_components": 15,
    "dynamic_eval_style": "yang",
    "dynamic_eval_lr": 0.002,
    "dynamic_eval_epsilon": 0.001,
}
PRESETS: dict[str, dict[str, Any]] = {
    "paper-ptb": {},
    "paper-wt2": _AWD_WT2,
    "mos-ptb": {
        **_MOS,
        "emsize": 280,
        "nhid": 960,
        "nhidlast": 620,
        "dropouti": 0.4,
        "dropouth": 0.225,
        "dropoutl": 0.29,
        "lr": 20.0,
        "batch_size": 12,
        "max_seq_len_delta": 40,
        "seed": 28,
        "dynamic_eval_lambda": 0.075,
    },
    "mos-wt2": {
        **_MOS,
        "corpus": "wikitext2",
        "emsize": 300,
        "nhid": 1150,
        "nhidlast": 650,
        "dropouti": 0.55,
        "dropouth": 0.2,
        "dropoutl": 0.29,
        "lr": 15.0,
        "batch_size": 15,
        "seed": 1882,
        "max_logprob_tokens": 40_000,
        "dynamic_eval_lambda": 0.02,
        "dynamic_eval_epsilon": 0.002,
    },
    # One PTB epoch in under 5 minutes on 2 CPU cores (see the measurements in results.json /
    # metrics.jsonl "seconds"): a smaller AWD-LSTM with the same regularisers.
    "cpu-small": {
        "emsize": 128,
        "nhid": 256,
        "bptt": 35,
        "batch_size": 64,
        "dropout": 0.3,
        "dropouth": 0.2,
        "dropouti": 0.3,
        "dropoute": 0.05,
        "wdrop": 0.3,
        "epochs": 30,
        "eval_batch_size": 64,
        "test_batch_size": 1,
        "max_logprob_tokens": 10_000,
        "dynamic_eval_max_batches": 200,
    },
    # Seconds: the fixture corpus (18 training tokens), a 2-layer model, every stage.
    "smoke": {
        "data_dir": str(FIXTURES_DIR),
        "emsize": 8,
        "nhid": 16,
        "nlayers": 2,
        "num_components": 2,
        "num_knots": 100,
        "batch_size": 2,
        "eval_batch_size": 1,
        "test_batch_size": 1,
        "bptt": 3,
        "seq_len_std": 1.0,
        "min_seq_len": 2,
        "max_seq_len_delta": 2,
        "lr": 1.0,
        "epochs": 3,
        "nonmono": 1,
        # Seconds on any corpus: on the fixtures these caps change nothing (18 training tokens);
        # with --data_dir pointing at real PTB the run reads a few hundred tokens of each split.
        "train_tokens": 200,
        "eval_tokens": 100,
        "logprob_block_tokens": 4,
        "dynamic_eval": True,
        "dynamic_eval_segment": 3,
        "dynamic_eval_batch_size": 2,
        "dynamic_eval_max_batches": 2,
    },
}

# Flags that may differ when a run is resumed: they change neither the model nor its training.
RESUMABLE_CHANGES = frozenset(
    {
        "epochs", "data_dir", "tfds_dir", "out_dir", "seq_len_bucket", "unroll",
        "test_batch_size", "max_logprob_tokens",
        "logprob_block_tokens", "dynamic_eval", "dynamic_eval_style", "dynamic_eval_lr",
        "dynamic_eval_lambda", "dynamic_eval_epsilon", "dynamic_eval_segment",
        "dynamic_eval_batch_size", "dynamic_eval_max_batches",
    }
)  # fmt: skip


class UsageError(Exception):
    """A problem with the command line or the files it names (exit status 2)."""


# ----------------------------------------------------------------------------------------------
# Building blocks


def load_data(config: Config) -> TokenizedCorpus:
    """The corpus as token ids; a missing or incomplete data folder is a :class:`UsageError`."""
    tfds_dir = config.tfds_dir or str(Path(config.out_dir) / "tfds")
    tfds.disable_progress_bar()  # one-off preparation; its nested bars only clutter the log
    try:
        return load_corpus(config.corpus, manual_dir=config.data_dir, data_dir=tfds_dir)
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(f"cannot load corpus {config.corpus!r}: {err}") from None


def shrink_corpus(corpus: TokenizedCorpus, config: Config) -> TokenizedCorpus:
    """``--vocab_size`` (counted on the whole training split), then the first ``--train_tokens`` /
    ``--eval_tokens`` tokens of the splits."""
    if config.vocab_size is not None:
        corpus = limit_vocabulary(corpus, config.vocab_size)
    return corpus._replace(
        train=corpus.train[: config.train_tokens],
        validation=corpus.validation[: config.eval_tokens],
        test=corpus.test[: config.eval_tokens],
    )


def build_model(config: Config, vocab_size: int, mesh: Mesh | None = None) -> AWDLSTM:
    model = AWDLSTM(
        vocab_size,
        emsize=config.emsize,
        nhid=config.nhid,
        nlayers=config.nlayers,
        nhidlast=config.nhidlast,
        head=config.head,
        dropout=config.dropout,
        dropouth=config.dropouth,
        dropouti=config.dropouti,
        dropoute=config.dropoute,
        wdrop=config.wdrop,
        dropoutl=config.dropoutl,
        tie_weights=config.tie_weights,
        unroll=config.unroll,
        rngs=nnx.Rngs(config.seed),
        mesh=mesh,
        **nn.head_options(config.head, bound=config.plif_bound, **dataclasses.asdict(config)),
    )
    return model if mesh is None else shard_model(model, mesh)


def build_trainer(config: Config, model: AWDLSTM, mesh: Mesh | None = None) -> LanguageModelTrainer:
    uses_plif = config.head in ("plif", "mos_plif")
    tx = make_optimizer(
        config.lr,
        optimizer=config.optimizer,
        plif_learning_rate=config.plif_lr if uses_plif else None,
        grad_clip_norm=config.clip or None,
        weight_decay=config.weight_decay,
    )
    return LanguageModelTrainer(
        AWDLSTMLanguageModel(model, alpha=config.alpha, beta=config.beta),
        tx,
        seed=config.seed,
        mesh=mesh,
    )


def check_resumable(run_root: Path, config: Config) -> None:
    """:class:`UsageError` if the run in ``run_root`` was made with incompatible flags."""
    path = run_root / "config.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())["config"]
    current = to_jsonable(config)
    changed = [
        f"{name}: {saved.get(name)!r} -> {value!r}"
        for name, value in current.items()
        if name not in RESUMABLE_CHANGES and saved.get(name) != value
    ]
    if changed:
        raise UsageError(
            f"{run_root} holds a checkpointed run with a different config ({'; '.join(changed)}); "
            "rerun with the same flags to resume it, or choose another --out_dir"
        )


def train_windows(config: Config, batched: np.ndarray, epoch: int):
    """Epoch ``epoch``'s training windows; the lengths are drawn from ``rng(seed, epoch)``."""
    return bptt_windows(
        batched,
        config.bptt,
        np.random.default_rng([config.seed, epoch]),
        seq_len_std=config.seq_len_std,
        min_seq_len=config.min_seq_len,
        max_seq_len_delta=config.max_seq_len_delta,
    )


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def epochs_since_best(records: list[dict[str, Any]]) -> int:
    """Epochs since the lowest validation loss in ``records`` (0: the last epoch is the best)."""
    losses = [record["valid_loss"] for record in records]
    return len(losses) - 1 - int(np.argmin(losses))


def stop_reason(records: list[dict[str, Any]], status: NtAsgdStatus, config: Config) -> str:
    """Why training ended (or ``"running"``): early stopping, NT-ASGD's finetune rule, epochs."""
    if any(record.get("early_stop") for record in records):
        return f"early stopping (no improvement for {config.patience} epochs)"
    if status.finished:
        return "finetune criterion (NT-ASGD)"
    if len(records) >= config.epochs:
        return f"epoch budget ({config.epochs})"
    return "running"


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite (exit status 1)."""


# ----------------------------------------------------------------------------------------------
# The run


class Run:
    """One training run: the trainer, its bookkeeping, checkpoints and metrics."""

    def __init__(
        self, config: Config, corpus: TokenizedCorpus, run: RunDir, store: CheckpointStore
    ):
        self.config, self.corpus, self.run, self.store = config, corpus, run, store
        mesh = mesh_from_flag(config.mesh)
        self.trainer = build_trainer(
            config, build_model(config, len(corpus.vocabulary), mesh), mesh
        )
        self.train_batched = batchify(corpus.train, config.batch_size)
        self.val_batched = batchify(corpus.validation, config.eval_batch_size)
        if self.train_batched.shape[0] < 3 or self.val_batched.shape[0] < 2:
            raise UsageError(
                f"corpus too small for batch_size {config.batch_size} / eval_batch_size "
                f"{config.eval_batch_size}: train {self.train_batched.shape}, validation "
                f"{self.val_batched.shape} after batchify"
            )
        # Copies: the training steps donate (and so delete) the state's own arrays.
        self.best_params = jax.tree.map(jnp.copy, self.trainer.state.params)
        self.status = NtAsgdStatus()
        self.epoch = 0  # completed epochs
        self.window = 0  # windows done in the current epoch
        self.carry = self.trainer.initial_carry(config.batch_size)
        self.partial = {"nll_sum": 0.0, "tokens": 0, "seconds": 0.0}
        self.records: list[dict[str, Any]] = []
        self.saved_step: int | None = None

    # -- checkpoints -------------------------------------------------------------------------

    def _items(self) -> dict[str, Any]:
        return {"state": self.trainer.state, "best_params": self.best_params, "carry": self.carry}

    def save(self) -> None:
        step = int(self.trainer.state.step)
        if step == self.saved_step:
            return
        meta = {
            "epoch": self.epoch,
            "window": self.window,
            "status": self.status._asdict(),
            "partial": self.partial,
            "records": self.records,
        }
        self.store.save(step, self._items(), to_jsonable(meta))
        self.saved_step = step

    def restore(self) -> bool:
        """Loads the latest checkpoint if there is one; rewrites metrics.jsonl from it."""
        step = self.store.latest_step()
        if step is None:
            return False
        items, meta = self.store.restore(self._items(), step)
        self.trainer.state = items["state"]
        self.best_params, self.carry = items["best_params"], items["carry"]
        self.epoch, self.window, self.partial = meta["epoch"], meta["window"], meta["partial"]
        status = meta["status"]
        self.status = NtAsgdStatus(
            tuple(status["val_history"]),
            status["best_val_loss"],
            status["averaging"],
            status["finished"],
        )
        self.records = meta["records"]
        self.saved_step = step
        # The checkpoint is the truth: drop lines of unfinished epochs, restore lost ones.
        with self.run.path("metrics.jsonl").open("w") as f:
            f.writelines(json.dumps(record) + "\n" for record in self.records)
        if self.epoch >= self.config.epochs or self.status.finished:
            print(f"resumed {self.run.root}: training is complete, evaluating its best model")
        else:
            print(f"resumed {self.run.root} at epoch {self.epoch + 1}, window {self.window}")
        return True

    def start_finetune(self, source: str) -> None:
        """Finetune stage: start from ``source``'s best model, averaging from the first step."""
        with CheckpointStore(Path(source) / "checkpoints") as src:
            if src.latest_step() is None:
                raise UsageError(f"--finetune_from {source}: no checkpoint in {src.directory}")
            try:
                items, _ = src.restore({"best_params": self.trainer.state.params})
            except ValueError as err:
                raise UsageError(f"--finetune_from {source}: {err}") from None
        params = items["best_params"]
        copy = functools.partial(jax.tree.map, jnp.copy)
        self.trainer.state = self.trainer.state._replace(params=copy(params), average=copy(params))
        val_loss = self.trainer.evaluate(params, self.val_batched, self.config.bptt)
        self.best_params = params
        self.status = NtAsgdStatus(best_val_loss=val_loss, averaging=True)
        print(
            f"finetuning {source}: its best model has validation perplexity {perplexity(val_loss):.2f}"
        )

    # -- training ------------------------------------------------------------------------------

    def train(self, stop: StopSignals) -> None:
        config = self.config
        finetune = config.finetune_from is not None
        while self.epoch < config.epochs and not self.status.finished:
            self._train_epoch(stop)
            eval_params = (
                self.trainer.state.average if self.status.averaging else self.trainer.state.params
            )
            start = time.perf_counter()
            val_loss = self.trainer.evaluate(eval_params, self.val_batched, config.bptt)
            val_seconds = time.perf_counter() - start
            outcome = end_of_epoch(
                self.status,
                val_loss,
                nonmono=config.nonmono,
                finetune=finetune,
                can_switch=config.optimizer == "sgd",
            )
            if outcome.improved:
                self.best_params = jax.tree.map(jnp.copy, eval_params)
            if outcome.switched:  # the average starts from the next iterate
                self.trainer.state = self.trainer.state._replace(
                    num_averaged=jnp.zeros((), jnp.int32)
                )
            seconds = self.partial["seconds"]
            record = {
                "event": "epoch",
                "stage": "finetune" if finetune else "train",
                "epoch": self.epoch + 1,
                "step": int(self.trainer.state.step),
                "train_loss": self.partial["nll_sum"] / max(self.partial["tokens"], 1),
                "train_ppl": perplexity(self.partial["nll_sum"] / max(self.partial["tokens"], 1)),
                "valid_loss": val_loss,
                "valid_ppl": perplexity(val_loss),
                "best_valid_ppl": perplexity(outcome.status.best_val_loss),
                "averaged": self.status.averaging,
                "switched_to_asgd": outcome.switched,
                "seconds": seconds,
                "tokens_per_second": self.partial["tokens"] / max(seconds, 1e-9),
                "valid_seconds": val_seconds,
            }
            self.status = outcome.status
            self.records.append(record)
            if config.patience is not None and epochs_since_best(self.records) >= config.patience:
                record["early_stop"] = True
                self.status = self.status._replace(finished=True)
            self.epoch, self.window = self.epoch + 1, 0
            self.carry = self.trainer.initial_carry(config.batch_size)
            self.partial = {"nll_sum": 0.0, "tokens": 0, "seconds": 0.0}
            self.save()
            self.run.log_metrics(record)
            tqdm.write(
                f"epoch {record['epoch']:4d} | train ppl {record['train_ppl']:9.2f} | valid ppl "
                f"{record['valid_ppl']:9.2f} | {seconds:7.1f} s | {record['tokens_per_second']:8.0f} "
                f"tok/s{' | ASGD' if self.status.averaging else ''}"
                f"{' (switched)' if outcome.switched else ''}"
            )
            if stop.requested:
                raise SystemExit(stop.exit_code)
            if self.status.finished:
                tqdm.write(f"{stop_reason(self.records, self.status, config)}: training stops")

    def _train_epoch(self, stop: StopSignals) -> None:
        config, batch = self.config, self.config.batch_size
        total = sum(1 for _ in train_windows(config, self.train_batched, self.epoch))
        windows = itertools.islice(
            train_windows(config, self.train_batched, self.epoch), self.window, None
        )
        bar = progress(
            windows, total=total - self.window, desc=f"epoch {self.epoch + 1}/{config.epochs}"
        )
        nll_sum, tokens = jnp.float32(self.partial["nll_sum"]), int(self.partial["tokens"])
        start = time.perf_counter()

        def keep_partial() -> None:
            self.partial = {
                "nll_sum": float(nll_sum),
                "tokens": tokens,
                "seconds": self.partial["seconds"] + time.perf_counter() - start,
            }

        for window in bar:
            padded = pad_window(window, padded_length(window.seq_len, config.seq_len_bucket))
            self.carry, metrics = self.trainer.train_step(
                self.carry, padded, window.lr_scale, averaging=self.status.averaging
            )
            nll_sum = nll_sum + metrics.nll * (window.seq_len * batch)
            tokens += window.seq_len * batch
            self.window += 1
            if self.window % 10 == 0:
                loss = float(nll_sum) / tokens
                self._check_finite(loss)
                bar.set_postfix(loss=f"{loss:.3f}", ppl=f"{perplexity(loss):.1f}")
            if stop.requested:  # the step is done: save where we are and leave
                self._check_finite(float(nll_sum) / tokens)  # never checkpoint a diverged state
                keep_partial()
                self.save()
                raise SystemExit(stop.exit_code)
        self._check_finite(float(nll_sum) / max(tokens, 1))
        keep_partial()

    def _check_finite(self, loss: float) -> None:
        """Stops a diverged run before anything of it is saved: its last checkpoint stays good."""
        if not math.isfinite(loss):
            kept = (
                f"the checkpoint of epoch {self.epoch} is kept in {self.store.directory}"
                if self.epoch
                else "there is no checkpoint yet"
            )
            raise TrainingDiverged(
                f"the training loss became {loss} in epoch {self.epoch + 1} (window "
                f"{self.window}); nothing of this epoch was saved and {kept}; lower --lr or --clip"
            )

    # -- final evaluation ------------------------------------------------------------------------

    def evaluate(self, stop: StopSignals) -> dict[str, Any]:
        """Validation and test perplexity of the best model, test log-probs, dynamic evaluation."""
        config, params = self.config, self.best_params
        with Ticker(stop, num_eval_windows(self.val_batched, config.bptt), "validation") as tick:
            valid_loss = self.trainer.evaluate(
                params, self.val_batched, config.bptt, on_window=tick
            )
        test_batched = batchify(self.corpus.test, config.test_batch_size)
        writer = None
        if config.max_logprob_tokens != 0:
            writer = LogProbBlockWriter(
                self.run.root / "log_probs",
                block_rows=config.logprob_block_tokens,
                max_rows=config.max_logprob_tokens,
            )
        start = time.perf_counter()
        with Ticker(stop, num_eval_windows(test_batched, config.bptt), "test") as tick:
            test_loss = self.trainer.evaluate(
                params, test_batched, config.bptt, writer=writer, on_window=tick
            )
        test_seconds = time.perf_counter() - start
        seconds = [record["seconds"] for record in self.records]
        results: dict[str, Any] = {
            "head": config.head,
            "corpus": config.corpus,
            "num_params": sum(int(np.size(x)) for x in jax.tree.leaves(params)),
            "epochs_trained": self.epoch,
            "stop_reason": stop_reason(self.records, self.status, config),
            "data": self.corpus.provenance(),  # the files' SHA-256 and full token counts
            "tokens_used": {
                "train": len(self.corpus.train),
                "validation": len(self.corpus.validation),
                "test": len(self.corpus.test),
            },
            "asgd_switch_epoch": next(
                (r["epoch"] for r in self.records if r["switched_to_asgd"]), None
            ),
            "best_valid_ppl_during_training": perplexity(self.status.best_val_loss),
            "valid_loss": valid_loss,
            "valid_ppl": perplexity(valid_loss),
            "test_loss": test_loss,
            "test_ppl": perplexity(test_loss),
            "test_seconds": test_seconds,
            "seconds_per_epoch": float(np.median(seconds)) if seconds else None,
        }
        if writer is not None:
            np.save(self.run.path("log_prob_targets.npy"), writer.close())
            results["log_probs"] = {
                "dir": str(writer.directory),
                "files": len(writer.files),
                "rows": writer.rows_written,
                "vocab_size": len(self.corpus.vocabulary),
            }
        if config.dynamic_eval:
            results["dynamic_eval"] = self.dynamic_eval(params, stop)
        return results

    def dynamic_eval(self, params: Any, stop: StopSignals) -> dict[str, Any]:
        """Dynamic evaluation of ``params`` on the validation and test streams."""
        config = self.config
        stats_batched = batchify(self.corpus.train, config.dynamic_eval_batch_size)
        hyper = {
            "segment": config.dynamic_eval_segment,
            "lr": config.dynamic_eval_lr,
            "lamb": config.dynamic_eval_lambda,
            "epsilon": config.dynamic_eval_epsilon,
            "style": config.dynamic_eval_style,
        }
        results: dict[str, Any] = dict(hyper)
        stats = None
        for split, ids in (("valid", self.corpus.validation), ("test", self.corpus.test)):
            batched = batchify(ids, 1)  # one stream, as Krause's and Yang's dynamiceval.py
            total = num_eval_windows(batched, config.dynamic_eval_segment)
            if stats is None:  # the training-gradient statistics, once for both splits
                total += min(
                    num_eval_windows(stats_batched, config.dynamic_eval_segment),
                    config.dynamic_eval_max_batches or math.inf,
                )
            start = time.perf_counter()
            with Ticker(stop, int(total), f"dynamic eval ({split})") as tick:
                loss, stats = self.trainer.dynamic_evaluate(
                    params,
                    eval_windows(stats_batched, config.dynamic_eval_segment),
                    batched,
                    stats_batch_size=config.dynamic_eval_batch_size,
                    max_batches=config.dynamic_eval_max_batches,
                    stats=stats,
                    on_window=tick,
                    **hyper,
                )
            results[f"{split}_loss"], results[f"{split}_ppl"] = loss, perplexity(loss)
            results[f"{split}_seconds"] = time.perf_counter() - start
        return results


class Ticker:
    """A progress bar advanced once per window that stops the run on a pending signal."""

    def __init__(self, stop: StopSignals, total: int, desc: str):
        self.stop, self.bar = stop, progress(None, total=total, desc=desc)

    def __call__(self) -> None:
        self.bar.update(1)
        if self.stop.requested:  # nothing to save: the final evaluation is redone on resume
            raise SystemExit(self.stop.exit_code)

    def __enter__(self) -> Ticker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bar.close()


# ----------------------------------------------------------------------------------------------


def run_experiment(config: Config) -> dict[str, Any]:
    """Trains (or resumes, or finetunes) and evaluates; returns the results."""
    try:  # before the lock and checkpoints are created in another experiment's folder
        root = check_run_folder(config.out_dir, config)
    except RunFolderError as err:
        raise UsageError(str(err)) from None
    lock = RunLock(root)  # one process per run folder: no two runs share checkpoints
    try:
        lock.acquire()
    except RunFolderBusy as err:
        raise UsageError(str(err)) from None
    with lock, CheckpointStore(root / "checkpoints") as store, StopSignals() as stop:
        corpus = shrink_corpus(load_data(config), config)
        resuming = store.latest_step() is not None
        if resuming:
            check_resumable(root, config)
        run = open_run(root, config, resume=resuming)
        lm = Run(config, corpus, run, store)
        if not lm.restore() and config.finetune_from is not None:
            lm.start_finetune(config.finetune_from)
        print(
            f"{config.corpus}: vocabulary {len(corpus.vocabulary)}, train {len(corpus.train)} "
            f"tokens; head {config.head}, "
            f"{sum(int(np.size(x)) for x in jax.tree.leaves(lm.trainer.state.params)):,} parameters"
        )
        lm.train(stop)
        results = lm.evaluate(stop)
    run.write_json("results.json", results)
    run.log_metrics(
        {"event": "test", **{k: v for k, v in results.items() if not isinstance(v, dict)}}
    )
    summary = {k: results[k] for k in ("head", "epochs_trained", "valid_ppl", "test_ppl")}
    if "dynamic_eval" in results:
        summary |= {
            "dyn_valid_ppl": results["dynamic_eval"]["valid_ppl"],
            "dyn_test_ppl": results["dynamic_eval"]["test_ppl"],
        }
    print_table([summary], floatfmt=".2f")
    written = ["results.json", "metrics.jsonl", "config.json", "checkpoints/"]
    if "log_probs" in results:
        written += ["log_probs/", "log_prob_targets.npy"]
    print(f"\nwrote {run.root}/: {', '.join(written)}")
    return results


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
