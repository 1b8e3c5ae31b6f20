"""The parts of a language-model experiment's config that do not depend on the model.

Each part is a frozen dataclass that checks itself on construction
(:class:`~bottleneck.runs.cli.Checked`) and turns into what the library needs:

* :class:`DataConfig`: which corpus and how much of it (:meth:`~DataConfig.load`), the batch
  sizes and the training windows (:meth:`~DataConfig.train_windows`: AWD-LSTM's variable
  lengths around ``bptt``);
* :class:`HeadConfig`: the output head and its options (:meth:`~HeadConfig.options` for
  :func:`bottleneck.nn.make_head`);
* :class:`OptimizerConfig`: the optax transformation and its :class:`~bottleneck.train.nt_asgd.
  EpochPolicy` (NT-ASGD for SGD; AdamW with linear warmup and cosine decay keeps the best);
* :class:`TrainingConfig` and :class:`EvaluationConfig`: the run loop's own options
  (:func:`bottleneck.runs.run_loop.train_and_evaluate`).

A script nests them in its config (``data: DataConfig = DataConfig()``), adds its model's part,
and gets ``--data.batch_size`` style flags from :func:`bottleneck.runs.parse_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import optax
import tensorflow_datasets as tfds
import tyro

from bottleneck import nn
from bottleneck.data import CORPORA, BpttWindow, batchify, bptt_windows, load_corpus
from bottleneck.data.tfds_builders import TokenizedCorpus, limit_vocabulary
from bottleneck.nn.heads import LATENTS
from bottleneck.nn.presets import HeadName
from bottleneck.runs.cli import Checked, Count, Interval, NonNegative, Positive
from bottleneck.runs.folder import UsageError
from bottleneck.train.dynamic_eval import STYLES
from bottleneck.train.lm import padded_length
from bottleneck.train.nt_asgd import EpochPolicy, KeepBest, NtAsgd
from bottleneck.train.steps import make_optimizer

Corpus = Literal[tuple(CORPORA)]


@dataclasses.dataclass(frozen=True)
class DataConfig(Checked):
    """The corpus, how much of it, and how it is cut into batches and windows."""

    corpus: Corpus = "ptb"
    #: folder with the release files (or its parent); None: $BOTTLENECK_DATA_DIR
    data_dir: str | None = None
    tfds_dir: str | None = None  # where TFDS prepares the corpus; None: OUT_DIR/tfds
    #: keep the N most frequent training words, the others become <unk>
    vocab_size: Annotated[int, Interval("[2, inf)")] | None = None
    train_tokens: Count | None = None  # train on the first N training tokens only; None: all
    #: validate / test on the first N tokens of each split only; None: all
    eval_tokens: Count | None = None
    batch_size: Count = 20
    eval_batch_size: Count = 10  # validation batch
    bptt: Count = 70  # mean training window length; the evaluation windows' length
    seq_len_std: NonNegative[float] = 5.0
    min_seq_len: Count = 5
    max_seq_len_delta: NonNegative[int] = 20
    seq_len_bucket: Count = 8  # windows are padded to multiples of this (fewer compiles)

    def load(self, out_dir: str | Path) -> TokenizedCorpus:
        """The corpus as token ids: ``--vocab_size`` (counted on the whole training split), then
        the first ``--train_tokens`` / ``--eval_tokens`` of the splits; a missing or incomplete
        data folder is a :class:`~bottleneck.runs.folder.UsageError`."""
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


# The vocabulary of the abstract head HeadConfig builds to check its options.
_CHECKED_VOCABULARY = 16
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
class HeadConfig(Checked):
    """The output head (any of bottleneck.nn.HEAD_NAMES) and its options."""

    name: Annotated[HeadName, tyro.conf.arg(aliases=("--head",))] = "softmax"
    num_components: Count = 15  # K of mos / moss / mos_plif / mixtape
    num_knots: Count = 100_000  # PLIF knots
    plif_bound: float = 20.0
    plif_noise: float = 0.0
    num_hidden: Count = 16  # monotone_mlp width
    #: the mixtures' latent map: tanh (Yang et al.'s, for the AWD-LSTM) | linear (identity-
    #: initialised facets, Chang & McCallum 2022; in a Transformer prefer it: tanh latents
    #: saturate there, docs/guides/language_models.md).
    latent: Literal[LATENTS] = "tanh"
    #: mixtape: words seen fewer than this many times in the training split share one gate
    #: (Yang et al. 2019's gate sharing; their rows of the gates are then unused); None: every
    #: word has its own gate
    shared_gate_below: Positive | None = None
    #: MiB one chunk of the head's loss may use (None: the library's 32): speed and memory
    #: only, not the model; smaller chunks can be faster in a CPU's caches, larger on a GPU
    memory_budget_mib: Positive | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # The head's own checks (nn.check_head: built abstractly, nothing drawn), before a
        # script writes anything; a message names the field, not the constructor's argument.
        options = self.options()
        if "shared_gate_below" in options:  # the counts come from the data: any will do here
            options["token_counts"] = np.ones(_CHECKED_VOCABULARY)
        try:
            nn.check_head(self.name, vocab_size=_CHECKED_VOCABULARY, **options)
        except ValueError as err:
            message = str(err)
            for field, option in _OPTION_OF_FIELD.items():
                if field != option and message.startswith(f"{option} "):
                    message = field + message[len(option) :]
            named = message if repr(self.name) in message else f"head {self.name!r}: {message}"
            raise ValueError(named) from None

    @property
    def uses_plif(self) -> bool:
        return self.name in ("plif", "mos_plif")

    def options(self) -> dict[str, Any]:
        """The keyword options of :func:`bottleneck.nn.make_head` that this head takes.

        With gate sharing (``shared_gate_below``) the head also needs ``token_counts``, which
        come from the training split: :meth:`model_options`.
        """
        candidates = {option: getattr(self, field) for field, option in _OPTION_OF_FIELD.items()}
        if self.shared_gate_below is not None:
            candidates["shared_gate_below"] = self.shared_gate_below
        return nn.head_options(self.name, **candidates)

    @property
    def shares_gates(self) -> bool:
        """Whether this head shares one gate among its rare words (it needs their counts)."""
        return "shared_gate_below" in self.options()

    def model_options(self, token_counts: np.ndarray | None = None) -> dict[str, Any]:
        """:meth:`options` plus the training split's ``token_counts`` ``[M]`` where they count.

        Raises:
          ValueError: a head that shares gates without the counts.
        """
        options = self.options()
        if self.shares_gates:
            if token_counts is None:
                raise ValueError(
                    f"head {self.name!r} with shared_gate_below needs the training split's token "
                    "counts (np.bincount(corpus.train, minlength=vocab_size))"
                )
            options["token_counts"] = np.asarray(token_counts)
        return options

    def compute_options(self) -> dict[str, Any]:
        """The options of :func:`bottleneck.nn.make_head` that change its speed, not its model."""
        if self.memory_budget_mib is None:
            return {}
        return {"memory_budget": int(self.memory_budget_mib * 2**20)}

    def unused_fields(self) -> tuple[str, ...]:
        """The fields of options this head does not take (they cannot change its model)."""
        used = self.options()
        fields = [field for field, option in _OPTION_OF_FIELD.items() if option not in used]
        if self.shared_gate_below is not None and "shared_gate_below" not in used:
            fields.append("shared_gate_below")
        return tuple(fields)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Checked):
    """The optimizer: SGD with NT-ASGD (AWD-LSTM's), Adam, or AdamW with linear warmup and
    cosine decay (a Transformer's); clipping, weight decay."""

    #: sgd (NT-ASGD) | adam | adamw (warmup + cosine decay)
    name: Annotated[Literal["sgd", "adam", "adamw"], tyro.conf.arg(aliases=("--optimizer",))] = (
        "sgd"
    )
    lr: Positive = 30.0  # learning rate; adamw: its peak
    plif_lr: Positive | None = 0.02  # PLIF slopes' own learning rate (Ganea et al.); None: --lr
    clip: NonNegative[float] = 0.25  # global-norm clip; 0: off
    weight_decay: NonNegative[float] = 1.2e-6  # L2 on the gradient; adamw: decoupled, matrices only
    nonmono: Count = 5  # NT-ASGD: average once validation has not improved for N epochs
    warmup_steps: NonNegative[int] = 1000  # adamw: steps of linear warmup from 0 to --lr
    #: adamw: the cosine decay ends at this fraction of --lr, at the last epoch
    final_lr_fraction: Annotated[float, Interval("[0, 1]")] = 0.1
    #: adamw: the cosine decay's length in epochs, the rate constant after it (training can then
    #: go on at the final rate until validation stops improving); None: the epoch budget
    decay_epochs: Count | None = None

    def transformation(self, *, plif: bool, total_steps: int) -> optax.GradientTransformation:
        """The optax transformation; ``plif``: the model has PLIF slopes (their own rate).

        For ``adamw`` every rate follows :func:`optax.warmup_cosine_decay_schedule`: linear from
        0 to the rate over ``warmup_steps``, then a cosine to ``final_lr_fraction`` of it at
        ``total_steps`` (``decay_epochs``, or the epoch budget, × :meth:`DataConfig.steps_per_epoch`),
        constant after. The
        schedule reads the step count in the optimizer state, so a resumed run continues it.
        ``total_steps`` must exceed ``warmup_steps`` (a
        :class:`~bottleneck.runs.folder.UsageError` otherwise); SGD and Adam ignore it.
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
class TrainingConfig(Checked):
    """How long to train, and from where: the epoch budget, early stopping, finetuning."""

    epochs: Count = 1000
    #: early stopping: stop when validation has not improved for N epochs
    patience: Count | None = None
    #: run folder whose best model to finetune (averaging from the start)
    finetune_from: str | None = None


@dataclasses.dataclass(frozen=True)
class EvaluationConfig(Checked):
    """The final evaluation of the best model: test log-probabilities, dynamic evaluation."""

    test_batch_size: Count = 1
    #: test rows of log-probs to write; None: all, 0: none
    max_logprob_tokens: NonNegative[int] | None = None
    logprob_block_tokens: Count = 4096  # rows per .npy
    dynamic_eval: bool = False
    dynamic_eval_style: Literal[STYLES] = "krause"
    dynamic_eval_lr: Positive = 5e-5
    dynamic_eval_lambda: Positive = 0.002
    dynamic_eval_epsilon: Positive = 0.001
    dynamic_eval_segment: Count = 5  # tokens per update
    dynamic_eval_batch_size: Count = 100  # batch of the training-gradient statistics
    #: training batches for the statistics; None: one epoch
    dynamic_eval_max_batches: Count | None = None
