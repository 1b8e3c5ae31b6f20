"""The parts of a language-model experiment's config that do not depend on the model.

Each part is a frozen dataclass that validates itself and turns into what the library needs:

* :class:`DataConfig`: which corpus and how much of it (:meth:`~DataConfig.load`), the batch
  sizes and the training windows (:meth:`~DataConfig.train_windows`: AWD-LSTM's variable
  lengths around ``bptt``);
* :class:`HeadConfig`: the output head and its options (:meth:`~HeadConfig.options` for
  :func:`bottleneck.nn.make_head`);
* :class:`OptimizerConfig`: the optax transformation and its :class:`~bottleneck.train.nt_asgd.
  EpochPolicy` (NT-ASGD for SGD; AdamW with linear warmup and cosine decay keeps the best);
* :class:`TrainingConfig` and :class:`EvaluationConfig`: the run loop's own options
  (:func:`bottleneck.train.run_loop.train_and_evaluate`).

A script nests them in its config (``data: DataConfig = DataConfig()``), adds its model's part,
and gets ``--data.batch_size`` style flags from :func:`bottleneck.train.parse_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import optax
import tensorflow_datasets as tfds

from bottleneck import nn
from bottleneck.data import CORPORA, BpttWindow, batchify, bptt_windows, load_corpus
from bottleneck.data.tfds_builders import TokenizedCorpus, limit_vocabulary
from bottleneck.nn import HEAD_NAMES
from bottleneck.nn.heads import LATENTS
from bottleneck.train.dynamic_eval import STYLES
from bottleneck.train.experiment import UsageError
from bottleneck.train.lm import padded_length
from bottleneck.train.nt_asgd import EpochPolicy, KeepBest, NtAsgd
from bottleneck.train.steps import make_optimizer

OPTIMIZERS = ("sgd", "adam", "adamw")


def _help(text: str, **metadata: Any) -> dict[str, Any]:
    return {"help": text, **metadata}


def _check_positive(part: Any, *names: str) -> None:
    for name in names:
        if getattr(part, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(part, name)}")


def _check_positive_or_none(part: Any, *names: str) -> None:
    for name in names:
        if getattr(part, name) is not None and getattr(part, name) < 1:
            raise ValueError(f"{name} must be >= 1 or none, got {getattr(part, name)}")


def _check_non_negative(part: Any, *names: str) -> None:
    for name in names:
        if getattr(part, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(part, name)}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The corpus, how much of it, and how it is cut into batches and windows."""

    corpus: str = dataclasses.field(default="ptb", metadata=_help("ptb | wikitext2"))
    data_dir: str | None = dataclasses.field(
        default=None,
        metadata=_help("folder with the release files (or its parent); none: $BOTTLENECK_DATA_DIR"),
    )
    tfds_dir: str | None = dataclasses.field(
        default=None, metadata=_help("where TFDS prepares the corpus; none: OUT_DIR/tfds")
    )
    vocab_size: int | None = dataclasses.field(
        default=None,
        metadata=_help("keep the N most frequent training words, the others become <unk>"),
    )
    train_tokens: int | None = dataclasses.field(
        default=None, metadata=_help("train on the first N training tokens only; none: all")
    )
    eval_tokens: int | None = dataclasses.field(
        default=None,
        metadata=_help("validate / test on the first N tokens of each split only; none: all"),
    )
    batch_size: int = 20
    eval_batch_size: int = dataclasses.field(default=10, metadata=_help("validation batch"))
    bptt: int = dataclasses.field(
        default=70, metadata=_help("mean training window length; the evaluation windows' length")
    )
    seq_len_std: float = 5.0
    min_seq_len: int = 5
    max_seq_len_delta: int = 20
    seq_len_bucket: int = dataclasses.field(
        default=8, metadata=_help("windows are padded to multiples of this (fewer compiles)")
    )

    def validate(self) -> None:
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {', '.join(CORPORA)}, got {self.corpus!r}")
        _check_positive(self, "batch_size", "eval_batch_size", "bptt", "min_seq_len")
        _check_positive(self, "seq_len_bucket")
        _check_positive_or_none(self, "train_tokens", "eval_tokens")
        _check_non_negative(self, "seq_len_std", "max_seq_len_delta")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 or none, got {self.vocab_size}")

    def load(self, out_dir: str | Path) -> TokenizedCorpus:
        """The corpus as token ids: ``--vocab_size`` (counted on the whole training split), then
        the first ``--train_tokens`` / ``--eval_tokens`` of the splits; a missing or incomplete
        data folder is a :class:`~bottleneck.train.experiment.UsageError`."""
        tfds_dir = self.tfds_dir or str(Path(out_dir) / "tfds")
        tfds.disable_progress_bar()  # one-off preparation; its nested bars only clutter the log
        try:
            corpus = load_corpus(self.corpus, manual_dir=self.data_dir, data_dir=tfds_dir)
        except (FileNotFoundError, ValueError) as err:
            raise UsageError(f"cannot load corpus {self.corpus!r}: {err}") from None
        if self.vocab_size is not None:
            corpus = limit_vocabulary(corpus, self.vocab_size)
        return corpus._replace(
            train=corpus.train[: self.train_tokens],
            validation=corpus.validation[: self.eval_tokens],
            test=corpus.test[: self.eval_tokens],
        )

    @property
    def longest_window(self) -> int:
        """The most steps a window is padded to: ``bptt + max_seq_len_delta`` (the longest
        training window) rounded up to ``seq_len_bucket``; evaluation windows have ``bptt``."""
        return padded_length(self.bptt + self.max_seq_len_delta, self.seq_len_bucket)

    def steps_per_epoch(self, train: np.ndarray, seed: int) -> int:
        """Training windows (optimizer steps) in the first epoch over the token ids ``train``
        ``[N]``; later epochs differ by a few, their lengths being drawn anew."""
        return sum(1 for _ in self.train_windows(batchify(train, self.batch_size), 0, seed))

    def train_windows(self, batched: np.ndarray, epoch: int, seed: int) -> Iterator[BpttWindow]:
        """Epoch ``epoch``'s training windows; the lengths are drawn from ``rng(seed, epoch)``, so
        a resumed epoch sees the same windows."""
        return bptt_windows(
            batched,
            self.bptt,
            np.random.default_rng([seed, epoch]),
            seq_len_std=self.seq_len_std,
            min_seq_len=self.min_seq_len,
            max_seq_len_delta=self.max_seq_len_delta,
        )


# HeadConfig's fields by the make_head option each one is.
_OPTION_OF_FIELD = {
    "num_components": "num_components",
    "num_knots": "num_knots",
    "plif_bound": "bound",
    "plif_noise": "plif_noise",
    "num_hidden": "num_hidden",
    "latent": "latent",
}


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The output head (any of bottleneck.nn.HEAD_NAMES) and its options."""

    name: str = dataclasses.field(
        default="softmax", metadata=_help("one of " + ", ".join(HEAD_NAMES), flag="head")
    )
    num_components: int = dataclasses.field(
        default=15, metadata=_help("K of mos / moss / mos_plif")
    )
    num_knots: int = dataclasses.field(default=100_000, metadata=_help("PLIF knots"))
    plif_bound: float = 20.0
    plif_noise: float = 0.0
    num_hidden: int = dataclasses.field(default=16, metadata=_help("monotone_mlp width"))
    latent: str = dataclasses.field(
        default="tanh",
        metadata=_help(
            "the mixtures' latent map: tanh (Yang et al.) | linear (identity-initialised facets, "
            "Chang & McCallum 2022)"
        ),
    )

    def validate(self) -> None:
        if self.name not in HEAD_NAMES:
            raise ValueError(f"unknown head {self.name!r}; choose one of {', '.join(HEAD_NAMES)}")
        _check_positive(self, "num_components", "num_knots", "num_hidden")
        if self.latent not in LATENTS:
            raise ValueError(f"latent must be one of {', '.join(LATENTS)}, got {self.latent!r}")

    @property
    def uses_plif(self) -> bool:
        return self.name in ("plif", "mos_plif")

    def options(self) -> dict[str, Any]:
        """The keyword options of :func:`bottleneck.nn.make_head` that this head takes."""
        candidates = {option: getattr(self, field) for field, option in _OPTION_OF_FIELD.items()}
        return nn.head_options(self.name, **candidates)

    def unused_fields(self) -> tuple[str, ...]:
        """The fields of options this head does not take (they cannot change its model)."""
        used = self.options()
        return tuple(field for field, option in _OPTION_OF_FIELD.items() if option not in used)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer: SGD with NT-ASGD (AWD-LSTM's), Adam, or AdamW with linear warmup and
    cosine decay (a Transformer's); clipping, weight decay."""

    name: str = dataclasses.field(
        default="sgd",
        metadata=_help("sgd (NT-ASGD) | adam | adamw (warmup + cosine decay)", flag="optimizer"),
    )
    lr: float = dataclasses.field(default=30.0, metadata=_help("learning rate; adamw: its peak"))
    plif_lr: float | None = dataclasses.field(
        default=0.02, metadata=_help("PLIF slopes' own learning rate (Ganea et al.); none: --lr")
    )
    clip: float = dataclasses.field(default=0.25, metadata=_help("global-norm clip; 0: off"))
    weight_decay: float = dataclasses.field(
        default=1.2e-6, metadata=_help("L2 on the gradient; adamw: decoupled, matrices only")
    )
    nonmono: int = dataclasses.field(
        default=5,
        metadata=_help("NT-ASGD: average once validation has not improved for N epochs"),
    )
    warmup_steps: int = dataclasses.field(
        default=1000, metadata=_help("adamw: steps of linear warmup from 0 to --lr")
    )
    final_lr_fraction: float = dataclasses.field(
        default=0.1,
        metadata=_help("adamw: the cosine decay ends at this fraction of --lr, at the last epoch"),
    )
    decay_epochs: int | None = dataclasses.field(
        default=None,
        metadata=_help(
            "adamw: the cosine decay's length in epochs, the rate constant after it (training "
            "can then go on at the final rate until validation stops improving); none: the "
            "epoch budget"
        ),
    )

    def validate(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.plif_lr is not None and self.plif_lr <= 0:
            raise ValueError(f"plif_lr must be > 0 or none, got {self.plif_lr}")
        _check_non_negative(self, "clip", "weight_decay", "warmup_steps")
        _check_positive_or_none(self, "decay_epochs")
        _check_positive(self, "nonmono")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}")

    def transformation(self, *, plif: bool, total_steps: int) -> optax.GradientTransformation:
        """The optax transformation; ``plif``: the model has PLIF slopes (their own rate).

        For ``adamw`` every rate follows :func:`optax.warmup_cosine_decay_schedule`: linear from
        0 to the rate over ``warmup_steps``, then a cosine to ``final_lr_fraction`` of it at
        ``total_steps`` (``decay_epochs``, or the epoch budget, × :meth:`DataConfig.steps_per_epoch`),
        constant after. The
        schedule reads the step count in the optimizer state, so a resumed run continues it.
        ``total_steps`` must exceed ``warmup_steps`` (a
        :class:`~bottleneck.train.experiment.UsageError` otherwise); SGD and Adam ignore it.
        """
        rate, plif_rate = self.lr, (self.plif_lr if plif else None)
        if self.name == "adamw":
            if total_steps <= self.warmup_steps:
                raise UsageError(
                    f"warmup_steps {self.warmup_steps} must be below the run's {total_steps} "
                    "steps (epochs x windows per epoch): lower --warmup_steps or add --epochs"
                )

            def schedule(peak: float) -> optax.Schedule:
                return optax.warmup_cosine_decay_schedule(
                    0.0, peak, self.warmup_steps, total_steps, peak * self.final_lr_fraction
                )

            rate = schedule(rate)
            plif_rate = None if plif_rate is None else schedule(plif_rate)
        return make_optimizer(
            rate,
            optimizer=self.name,
            plif_learning_rate=plif_rate,
            grad_clip_norm=self.clip or None,
            weight_decay=self.weight_decay,
        )

    def policy(self, *, finetune: bool) -> EpochPolicy:
        """NT-ASGD for SGD (AWD-LSTM never averages Adam); a finetune stage, which averages from
        its first step, stops on NT-ASGD's rule whatever the optimizer."""
        if finetune or self.name == "sgd":
            return NtAsgd(self.nonmono, finetune=finetune)
        return KeepBest()


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """How long to train, and from where: the epoch budget, early stopping, finetuning."""

    epochs: int = 1000
    patience: int | None = dataclasses.field(
        default=None,
        metadata=_help("early stopping: stop when validation has not improved for N epochs"),
    )
    finetune_from: str | None = dataclasses.field(
        default=None,
        metadata=_help("run folder whose best model to finetune (averaging from the start)"),
    )

    def validate(self) -> None:
        _check_positive(self, "epochs")
        _check_positive_or_none(self, "patience")


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """The final evaluation of the best model: test log-probabilities, dynamic evaluation."""

    test_batch_size: int = 1
    max_logprob_tokens: int | None = dataclasses.field(
        default=None, metadata=_help("test rows of log-probs to write; none: all, 0: none")
    )
    logprob_block_tokens: int = dataclasses.field(default=4096, metadata=_help("rows per .npy"))
    dynamic_eval: bool = False
    dynamic_eval_style: str = dataclasses.field(default="krause", metadata=_help("krause | yang"))
    dynamic_eval_lr: float = 5e-5
    dynamic_eval_lambda: float = 0.002
    dynamic_eval_epsilon: float = 0.001
    dynamic_eval_segment: int = dataclasses.field(default=5, metadata=_help("tokens per update"))
    dynamic_eval_batch_size: int = dataclasses.field(
        default=100, metadata=_help("batch of the training-gradient statistics")
    )
    dynamic_eval_max_batches: int | None = dataclasses.field(
        default=None, metadata=_help("training batches for the statistics; none: one epoch")
    )

    def validate(self) -> None:
        _check_positive(self, "test_batch_size", "logprob_block_tokens", "dynamic_eval_segment")
        _check_positive(self, "dynamic_eval_batch_size")
        _check_positive_or_none(self, "dynamic_eval_max_batches")
        if self.max_logprob_tokens is not None and self.max_logprob_tokens < 0:
            raise ValueError(
                f"max_logprob_tokens must be >= 0 or none, got {self.max_logprob_tokens}"
            )
        if self.dynamic_eval_style not in STYLES:
            raise ValueError(
                f"dynamic_eval_style must be one of {STYLES}, got {self.dynamic_eval_style!r}"
            )
        for name in ("dynamic_eval_lr", "dynamic_eval_lambda", "dynamic_eval_epsilon"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
