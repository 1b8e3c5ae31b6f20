"""The language model experiment: its config, presets, model, run and the reading of a run back.

:class:`Config` is ``experiments/language_model.py``'s (the AWD-LSTM or a Transformer, any head,
PTB or WikiText-2; a preset of :data:`PRESETS` to start from); :func:`run_experiment` trains,
resumes or finetunes and evaluates it in a run folder (:func:`bottleneck.runs.run_loop.train_and_evaluate`
is the loop); :func:`load_run` rebuilds a finished run's model with its best parameters, whoever
trained it (the study's cells, a user's own runs); :func:`head_inputs` and
:func:`validation_windows` are what the diagnostics scripts measure a loaded model on.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import jax.numpy as jnp
import numpy as np
import tyro
from flax import nnx
from jax.sharding import Mesh

from bottleneck import nn
from bottleneck.data import FIXTURES_DIR, TokenizedCorpus, Vocabulary
from bottleneck.nn import HEAD_NAMES
from bottleneck.nn.awd_lstm import AWDLSTM, AWDLSTMLanguageModel
from bottleneck.nn.transformer import (
    NORMS,
    POSITION_ENCODINGS,
    Transformer,
    TransformerLanguageModel,
)
from bottleneck.runs.checkpoint import CheckpointStore
from bottleneck.runs.cli import Checked, Count, Dropout, NonNegative, markdown_table
from bottleneck.runs.folder import UsageError, config_from_jsonable
from bottleneck.runs.lm_config import (
    DataConfig,
    EvaluationConfig,
    HeadConfig,
    OptimizerConfig,
    TrainingConfig,
)
from bottleneck.runs.run_loop import (
    VOCABULARY_FILE,
    LanguageModelRun,
    open_session,
    train_and_evaluate,
    written_files,
)
from bottleneck.sharding import mesh_from_flag, require_data_divides, shard_model, use_mesh
from bottleneck.train import Trainer
from bottleneck.train.lm import LanguageModel


@dataclasses.dataclass(frozen=True)
class AWDLSTMConfig(Checked):
    """The AWD-LSTM (Merity et al. 2017): sizes, dropouts, AR / TAR."""

    family: ClassVar[str] = "awd_lstm"

    emsize: Count = 400
    nhid: Count = 1150
    nhidlast: Count | None = None  # last LSTM layer's size; None: emsize (needed for tying)
    nlayers: Count = 3
    tie_weights: bool = True
    dropout: Dropout = 0.4
    dropouth: Dropout = 0.25
    dropouti: Dropout = 0.4
    dropoute: Dropout = 0.1
    wdrop: Dropout = 0.5
    dropoutl: Dropout = 0.0  # mixture-latent dropout
    alpha: NonNegative[float] = 2.0  # AR scale
    beta: NonNegative[float] = 1.0  # TAR scale
    unroll: Count = 1  # LSTM scan unroll factor

    @property
    def head_width(self) -> int:
        """The head's input width d: the embedding's (tied; with nhidlast None, the last layer's)."""
        return self.emsize

    def with_head_width(self, d: int) -> AWDLSTMConfig:
        return replace(self, emsize=d)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(Checked):
    """The decoder-only Transformer (GPT-2 style): sizes, norm, dropouts."""

    family: ClassVar[str] = "transformer"

    d_model: Count = 256
    num_layers: Count = 4
    num_heads: Count = 4
    d_ff: Count | None = None  # MLP hidden width; None: 4 x d_model
    max_len: Count = 256  # longest window: >= bptt + max_seq_len_delta rounded up to the bucket
    position_encoding: Literal[POSITION_ENCODINGS] = "rope"
    norm: Literal[NORMS] = "rmsnorm"
    embedding_dropout: Dropout = 0.1
    residual_dropout: Dropout = 0.1  # on each block's attention and MLP outputs
    attention_dropout: Dropout = 0.1  # on the attention weights
    tie_weights: bool = True
    #: the head's input width d behind learned projections (the bottleneck, with the trunk
    #: unchanged; tied: a factorized d-wide embedding); None: d_model
    head_features: Count | None = None
    #: the input embedding's width e, the same at every --head_features: a table E [M, e],
    #: projected to d_model unless e = d_model, and (tied) the head's decoder E Q, Q a learned
    #: [e, d] map, so that only the head changes with d (e = d_model: the trunk of the model
    #: without --head_features); None: d_model wide, or d wide when tied with --head_features
    #: (the factorized table)
    embedding_features: Count | None = None

    @property
    def head_width(self) -> int:
        """The head's input width d: head_features, or the trunk's width."""
        return self.head_features or self.d_model

    def with_head_width(self, d: int) -> TransformerConfig:
        return replace(self, head_features=d)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads {self.num_heads} must divide d_model {self.d_model}")
        if self.position_encoding == "rope" and (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"rope needs an even head size d_model / num_heads, got "
                f"{self.d_model} / {self.num_heads}"
            )


# The model families, a subcommand each (model:awd_lstm, model:transformer).
MODELS = (AWDLSTMConfig, TransformerConfig)
ModelConfig = Union[tuple(Annotated[cls, tyro.conf.subcommand(cls.family)] for cls in MODELS)]  # noqa: UP007


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """AWD-LSTM or Transformer language model on PTB / WikiText-2 with any output head (defaults:
    AWD-LSTM paper-ptb)."""

    model: ModelConfig = AWDLSTMConfig()
    data: DataConfig = DataConfig()
    head: HeadConfig = HeadConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    seed: int = 141
    mesh: str = ""  # device mesh, e.g. data=4,vocab=2; empty: all devices on data
    out_dir: str = "runs/language_model"

    def __post_init__(self) -> None:
        """How the parts fit (each part checked itself)."""
        super().__post_init__()
        if isinstance(self.model, TransformerConfig):
            self._check_transformer()
            return
        model, head = self.model, self.head.name
        mixtures = [name for name in HEAD_NAMES if nn.is_mixture_preset(name)]
        if model.dropoutl > 0 and head not in mixtures:
            raise ValueError(f"dropoutl > 0 needs a mixture head ({', '.join(mixtures)})")
        if (
            model.tie_weights
            and head not in mixtures
            and model.nhidlast not in (None, model.emsize)
        ):
            raise ValueError(
                f"tie_weights with head {head!r} needs nhidlast == emsize ({model.emsize}), "
                f"got {model.nhidlast}"
            )

    def _check_transformer(self) -> None:
        if self.optimizer.name == "sgd":
            # The defaults are the AWD-LSTM's (SGD at lr 30): no recipe for a Transformer.
            raise ValueError(
                "the transformer trains with --optimizer adamw (or adam), not sgd / NT-ASGD; "
                "start from the preset transformer-cpu, transformer-gpu or transformer-smoke"
            )
        longest = self.data.longest_window
        if self.evaluation.dynamic_eval:
            longest = max(longest, self.evaluation.dynamic_eval_segment)
        if self.model.max_len < longest:
            raise ValueError(
                f"max_len {self.model.max_len} must cover the longest window, {longest} "
                "steps (bptt + max_seq_len_delta rounded up to seq_len_bucket, or "
                "dynamic_eval_segment)"
            )

    def cell(
        self, head: str, d: int, *, out_dir: str, tfds_dir: str, seed: int | None = None
    ) -> Config:
        """This config with ``head`` reading a ``d``-wide input (a cell of a grid over heads
        and d), in its own ``out_dir``, with the prepared corpus shared in ``tfds_dir``."""
        return replace(
            self,
            model=self.model.with_head_width(d),
            data=replace(self.data, tfds_dir=tfds_dir),
            head=replace(self.head, name=head),
            seed=self.seed if seed is None else seed,
            out_dir=out_dir,
        )

    @property
    def resumable_changes(self) -> tuple[str, ...]:
        """The fields a resumed run may change: ``RESUMABLE_CHANGES``, but ``training.epochs``
        when it sets the length of AdamW's schedule (no ``decay_epochs``), and the head options
        its head does not take."""
        fields = RESUMABLE_CHANGES
        if self.optimizer.name == "adamw" and self.optimizer.decay_epochs is None:
            fields = tuple(name for name in fields if name != "training.epochs")
        return (*fields, *(f"head.{name}" for name in self.head.unused_fields()))


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
_YANG_EVALUATION = EvaluationConfig(
    dynamic_eval_style="yang", dynamic_eval_lr=0.002, dynamic_eval_epsilon=0.001
)
# Seconds on any corpus: on the fixtures the token caps change nothing (18 training tokens); with
# --data_dir pointing at real PTB the run reads a few hundred tokens of each split.
_SMOKE_DATA = DataConfig(
    data_dir=str(FIXTURES_DIR), batch_size=2, eval_batch_size=1, bptt=3, seq_len_std=1.0,
    min_seq_len=2, max_seq_len_delta=2, train_tokens=200, eval_tokens=100,
)  # fmt: skip
_SMOKE_HEAD = HeadConfig(num_components=2, num_knots=100)
_SMOKE_EVALUATION = EvaluationConfig(
    logprob_block_tokens=4, dynamic_eval=True, dynamic_eval_segment=3, dynamic_eval_batch_size=2,
    dynamic_eval_max_batches=2,
)  # fmt: skip
# The Transformer's optimizer (GPT-2 practice): AdamW, clipping at 1, decoupled weight decay 0.1
# of the matrices, linear warmup then cosine decay; mixtures with linear latents. PLIF's slopes
# follow the same schedule at the same rate: an Adam step is about the rate whatever the
# gradient's scale, so Ganea et al.'s 0.02 (set beside the AWD-LSTM's SGD at 30) would move them
# 10-40 times as fast as the rest here.
_ADAMW = OptimizerConfig("adamw", clip=1.0, weight_decay=0.1, plif_lr=None)
# Identity-initialised linear facets: tanh latents saturate behind a pre-norm trunk and cap a
# mixture's logit spread (MoS 117 +- 34 against softmax's 57 with tanh;
# docs/guides/language_models.md).
_LINEAR = HeadConfig(latent="linear")
# The 2-core CPU's Transformer: width 128, 4 heads, batch 32 x bptt 64 (its depth per preset).
_CPU_TRANSFORMER = TransformerConfig(
    d_model=128, num_heads=4, d_ff=512, max_len=128, attention_dropout=0.0
)
_CPU_DATA = DataConfig(batch_size=32, eval_batch_size=16, bptt=64)
PRESETS: dict[str, Config] = {
    "paper-ptb": Config(),
    "paper-wt2": Config(
        model=AWDLSTMConfig(dropouti=0.65, dropouth=0.2),
        data=DataConfig(corpus="wikitext2", batch_size=80),
        training=TrainingConfig(epochs=1500),
        # Full test log-probs would be 245,569 x 33,278 float32 = 33 GB; 40k rows are 5.3 GB.
        evaluation=EvaluationConfig(max_logprob_tokens=40_000),
        seed=1882,
    ),
    "mos-ptb": Config(
        model=AWDLSTMConfig(
            emsize=280, nhid=960, nhidlast=620, dropouti=0.4, dropouth=0.225, dropoutl=0.29
        ),
        data=DataConfig(batch_size=12, max_seq_len_delta=40),
        head=HeadConfig("mos"),
        optimizer=OptimizerConfig(lr=20.0),
        evaluation=replace(_YANG_EVALUATION, dynamic_eval_lambda=0.075),
        seed=28,
    ),
    "mos-wt2": Config(
        model=AWDLSTMConfig(
            emsize=300, nhid=1150, nhidlast=650, dropouti=0.55, dropouth=0.2, dropoutl=0.29
        ),
        data=DataConfig(corpus="wikitext2", batch_size=15),
        head=HeadConfig("mos"),
        optimizer=OptimizerConfig(lr=15.0),
        evaluation=replace(
            _YANG_EVALUATION,
            max_logprob_tokens=40_000,
            dynamic_eval_lambda=0.02,
            dynamic_eval_epsilon=0.002,
        ),
        seed=1882,
    ),
    # One PTB epoch in under 5 minutes on 2 CPU cores (see the measurements in results.json /
    # metrics.jsonl "seconds"): a smaller AWD-LSTM with the same regularisers.
    "cpu-small": Config(
        model=AWDLSTMConfig(
            emsize=128, nhid=256, dropout=0.3, dropouth=0.2, dropouti=0.3, dropoute=0.05, wdrop=0.3
        ),
        data=DataConfig(bptt=35, batch_size=64, eval_batch_size=64),
        training=TrainingConfig(epochs=30),
        evaluation=EvaluationConfig(max_logprob_tokens=10_000, dynamic_eval_max_batches=200),
    ),
    # Seconds: the fixture corpus (18 training tokens), a 2-layer model, every stage.
    "smoke": Config(
        model=AWDLSTMConfig(emsize=8, nhid=16, nlayers=2),
        data=_SMOKE_DATA,
        head=_SMOKE_HEAD,
        optimizer=OptimizerConfig(lr=1.0, nonmono=1),
        training=TrainingConfig(epochs=3),
        evaluation=_SMOKE_EVALUATION,
    ),
    "transformer-smoke": Config(
        model=TransformerConfig(d_model=8, num_layers=2, num_heads=2, max_len=8),
        data=_SMOKE_DATA,
        head=replace(_SMOKE_HEAD, latent="linear"),
        optimizer=replace(_ADAMW, lr=0.03, warmup_steps=2),
        training=TrainingConfig(epochs=3),
        evaluation=_SMOKE_EVALUATION,
    ),
    # Minutes per head on 2 CPU cores. Measured first (training steps alone, softmax, on a
    # slower, loaded machine): 2,600 tokens/s with PTB's 2,000 most frequent words (as
    # experiments/lm_study.py) against 1,500 with all 10,000, whose head is then half the step; so
    # 2,000 words and two epochs: 11-15 minutes per head there, under 4 on an idle Zen 5
    # (softmax, sigsoftmax, PLIF, MoS, three seeds; docs/guides/language_models.md).
    "transformer-cpu": Config(
        model=replace(_CPU_TRANSFORMER, num_layers=4),
        data=replace(_CPU_DATA, vocab_size=2000),
        head=replace(_LINEAR, num_components=3, num_knots=10_000),
        optimizer=replace(_ADAMW, lr=2e-3, warmup_steps=100),
        training=TrainingConfig(epochs=2),
        evaluation=EvaluationConfig(
            max_logprob_tokens=10_000, dynamic_eval_segment=64, dynamic_eval_max_batches=50
        ),
    ),
    # The trunk and schedule of experiments/lm_study.py's converged grid (docs/lm_study.md has
    # the pilot that chose them): all of PTB's 10,000 words, the head at its own width d
    # (--head_features, set by each cell) behind a 2-layer trunk; a cosine over 10 epochs to 1% of
    # the peak rate, then three epochs at that rate, so that a cell ends when validation stops
    # improving (early stopping) or has improved less than 0.5% in those three epochs.
    "transformer-study": Config(
        model=replace(_CPU_TRANSFORMER, num_layers=2),
        data=_CPU_DATA,
        head=replace(_LINEAR, num_components=4, num_knots=10_000),
        optimizer=replace(
            _ADAMW, lr=3e-3, warmup_steps=200, decay_epochs=10, final_lr_fraction=0.01
        ),
        training=TrainingConfig(epochs=13, patience=1),
        evaluation=EvaluationConfig(max_logprob_tokens=0),
    ),
    # A GPU-sized starting point (not run here, not tuned): GPT-2-small-like width, strong
    # dropout (PTB's million training tokens are few for 20M parameters), early stopping.
    "transformer-gpu": Config(
        model=TransformerConfig(
            d_model=512,
            num_layers=6,
            num_heads=8,
            d_ff=2048,
            max_len=256,
            embedding_dropout=0.3,
            residual_dropout=0.3,
        ),  # fmt: skip
        data=DataConfig(batch_size=32, bptt=128, max_seq_len_delta=32, eval_batch_size=16),
        head=_LINEAR,
        optimizer=replace(_ADAMW, lr=5e-4, warmup_steps=1000),
        training=TrainingConfig(epochs=100, patience=10),
        evaluation=EvaluationConfig(max_logprob_tokens=40_000, dynamic_eval_segment=128),
    ),
}


# Fields that change how a run computes, not what (its numbers move by round-off at most):
# a finished run read back with other values is still the same run (named as config.json records
# them: the chosen model's fields under its family's name).
COMPUTE_ONLY = ("data.seq_len_bucket", "awd_lstm.unroll", "head.memory_budget_mib", "out_dir")
# Fields that may differ when a run is resumed: they change neither the model nor its training.
RESUMABLE_CHANGES = (
    *COMPUTE_ONLY, "training.epochs", "data.data_dir", "data.tfds_dir", "evaluation",
)  # fmt: skip


def build_model(
    config: Config, vocab_size: int, token_counts: np.ndarray | None = None
) -> LanguageModel:
    """The configured model with its head behind the run loop's interface, initialised from
    ``config.seed`` (build it under the run's mesh). ``token_counts`` ``[vocab_size]``: the
    training split's counts of each word (:func:`training_counts`), needed by a head that
    shares gates (Mixtape's ``--head.shared_gate_below``)."""
    rngs = nnx.Rngs(config.seed)
    head = {
        "head": config.head.name,
        **config.head.model_options(token_counts),
        **config.head.compute_options(),
    }
    options = dataclasses.asdict(config.model)
    if isinstance(config.model, TransformerConfig):
        return TransformerLanguageModel(Transformer(vocab_size, rngs=rngs, **options, **head))
    alpha, beta = options.pop("alpha"), options.pop("beta")
    return AWDLSTMLanguageModel(
        AWDLSTM(vocab_size, rngs=rngs, **options, **head), alpha=alpha, beta=beta
    )


def training_counts(config: Config, corpus: TokenizedCorpus) -> np.ndarray | None:
    """Each word's count in the training split ``[M]``, where the head uses them (else None)."""
    if not config.head.shares_gates:
        return None
    return np.bincount(np.asarray(corpus.train), minlength=len(corpus.vocabulary))


def build_trainer(config: Config, corpus: TokenizedCorpus, mesh: Mesh | None) -> Trainer:
    """The model and its optimizer, placed on ``mesh`` (call it under the mesh)."""
    model = build_model(config, len(corpus.vocabulary), training_counts(config, corpus))
    if mesh is not None:
        model = shard_model(model, mesh)
    epochs = config.optimizer.decay_epochs or config.training.epochs
    steps = epochs * config.data.steps_per_epoch(corpus.train, config.seed)
    return Trainer(
        model,
        config.optimizer.transformation(plif=config.head.uses_plif, total_steps=steps),
        seed=config.seed,
        mesh=mesh,
    )


def run_experiment(config: Config) -> dict[str, Any]:
    """Trains (or resumes, or finetunes) and evaluates; prints the summary and returns the
    results."""
    try:  # this process's devices: checked before the folder is touched
        mesh = mesh_from_flag(config.mesh)
        require_data_divides(config.mesh, "batch_size", config.data.batch_size)
    except ValueError as err:
        raise UsageError(str(err)) from None
    # The mesh comes from context, as in Flax: the model is built and traced under it.
    with (
        open_session(config.out_dir, config, may_change=config.resumable_changes) as session,
        use_mesh(mesh),
    ):
        corpus, root = config.data.load(config.out_dir), session.run.root
        run = LanguageModelRun(
            build_trainer(config, corpus, mesh),
            corpus,
            session,
            data=config.data,
            training=config.training,
            evaluation=config.evaluation,
            policy=config.optimizer.policy(finetune=config.training.finetune_from is not None),
            seed=config.seed,
        )
        results = train_and_evaluate(
            run,
            describe={
                "model": config.model.family,
                "head": config.head.name,
                "corpus": config.data.corpus,
            },
        )
    shown = ("model", "head", "corpus", "epochs_trained", "valid_ppl", "test_ppl")
    summary = {key: results[key] for key in shown}
    if "dynamic_eval" in results:
        summary |= {f"dyn_{k}": results["dynamic_eval"][k] for k in ("valid_ppl", "test_ppl")}
    print(markdown_table([summary], floatfmt=".2f"))
    print(f"\nwrote {root}/: {', '.join(written_files(results))}")
    return results


def load_run(run_dir: str | Path) -> tuple[Config, Vocabulary, nnx.Module]:
    """The run's config, vocabulary and model with its best parameters."""
    root = Path(run_dir)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise UsageError(f"{root} is not a language_model.py run folder: it has no config.json")
    try:
        saved = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{config_path} is not valid JSON: {err}") from None
    owner = saved.get("experiment") if isinstance(saved, dict) else None
    if owner != "language_model":
        raise UsageError(
            f"{root} holds a run of {owner or 'an unknown experiment'}, not of language_model.py"
        )
    if not isinstance(saved.get("config"), dict):
        raise UsageError(f"{config_path} records no config")
    try:
        config = config_from_jsonable(Config, saved["config"])
    except (ValueError, TypeError) as err:
        raise UsageError(
            f"{config_path} does not load in this language_model.py ({err}): the run was made by "
            "another version of it"
        ) from None
    # The run's corpus is prepared under its own folder (tfds_dir None: OUT_DIR/tfds), wherever
    # the folder is now.
    config = dataclasses.replace(config, out_dir=str(root))
    checkpoints = root / "checkpoints"
    if not checkpoints.is_dir():
        raise UsageError(f"{root} has no checkpoints/ folder: the run never saved a model")
    vocab_path = root / VOCABULARY_FILE
    counts = None
    if vocab_path.is_file() and not config.head.shares_gates:
        vocabulary = Vocabulary.read(vocab_path)
    else:  # a head that shares gates is built from the training split's counts
        corpus = config.data.load(root)
        vocabulary, counts = corpus.vocabulary, training_counts(config, corpus)
    model = build_model(config, len(vocabulary), counts)
    with CheckpointStore(checkpoints) as store:
        if store.latest_step() is None:
            raise UsageError(f"{checkpoints} holds no checkpoint: the run never saved a model")
        try:
            items, _ = store.restore({"best_params": nnx.state(model, nnx.Param)})
        except ValueError as err:
            raise UsageError(f"cannot load the model of {root}: {err}") from None
    nnx.update(model, items["best_params"])
    return config, vocabulary, model.model


def head_inputs(model: Any, windows: np.ndarray) -> jnp.ndarray:
    """The head's inputs ``[B, T, d]`` for token windows ``[B, T]`` (deterministic)."""
    if isinstance(model, Transformer):
        return model.head_input(model.features(jnp.asarray(windows)))
    return jnp.swapaxes(model.rnn(jnp.asarray(windows.T)).output, 0, 1)


def validation_windows(
    validation: np.ndarray, tokens: int, bptt: int, flag: str = "--tokens"
) -> tuple[np.ndarray, np.ndarray]:
    """The first whole windows ``[count, bptt]`` of ``validation`` within ``tokens`` positions,
    and their next-token targets (so the last window needs one token after it)."""
    count = min(tokens, len(validation) - 1) // bptt
    if count < 1:
        raise UsageError(f"{flag} {tokens} holds no whole window of bptt {bptt}")
    inputs = validation[: count * bptt].reshape(count, bptt)
    targets = validation[1 : count * bptt + 1].reshape(count, bptt)
    return inputs, targets
