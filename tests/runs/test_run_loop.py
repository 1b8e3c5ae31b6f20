"""The run loop (bottleneck.runs.run_loop) with a tiny model: epochs, resuming, stopping, policies.

The model is a bigram-plus-carry table model: the logits of the next token are
``table[x_t] + prev[x_{t-1}]``, where ``x_{-1}`` is the carry (the last token of the previous
window) or, for the stateless variant (``initial_carry`` returns None, as a Transformer), a fixed
token. Its objective scales the logits by a factor drawn from the step's key, standing in for
dropout, so that a resumed run must replay the same keys to match. The key's bits are used as
they are: threefry draws would double the compile time, which dominates these tests; for the same
reason every training window is padded to one length.
"""

import dataclasses
import json
import os
import signal
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bottleneck.data import TokenizedCorpus, Vocabulary, batchify
from bottleneck.runs import TrainingInterrupted, UsageError
from bottleneck.runs.cli import show_logs
from bottleneck.runs.lm_config import DataConfig, EvaluationConfig, TrainingConfig
from bottleneck.runs.run_loop import (
    LanguageModelRun,
    TrainingDiverged,
    epochs_since_best,
    open_session,
    stop_reason,
    train_and_evaluate,
)
from bottleneck.train import Trainer
from bottleneck.train.nt_asgd import KeepBest, NtAsgd, NtAsgdStatus

VOCAB = 8


class Aux(NamedTuple):
    nll: jax.Array
    carry: Any


class TableModel(nnx.Module):
    def __init__(self, *, stateful: bool, seed: int = 0):
        keys = jax.random.split(jax.random.key(seed))
        self.table = nnx.Param(0.1 * jax.random.normal(keys[0], (VOCAB, VOCAB)))
        self.prev = nnx.Param(0.1 * jax.random.normal(keys[1], (VOCAB, VOCAB)))
        self.stateful = stateful

    def initial_carry(self, batch_size: int) -> jax.Array | None:
        return jnp.zeros((batch_size,), jnp.int32) if self.stateful else None

    def _logits(self, tokens: jax.Array, carry: jax.Array | None, length: jax.Array):
        first = jnp.zeros(tokens.shape[:1], jnp.int32) if carry is None else carry
        previous = jnp.concatenate([first[:, None], tokens[:, :-1]], axis=1)
        logits = self.table[...][tokens] + self.prev[...][previous]
        last = jnp.take_along_axis(tokens, jnp.broadcast_to(length - 1, first.shape)[:, None], 1)
        return logits, (None if carry is None else last[:, 0])

    def _mean_nll(self, logits, targets, length):
        log_probs = jax.nn.log_softmax(logits)
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        real = jnp.arange(targets.shape[1]) < length
        count = jnp.sum(jnp.broadcast_to(real, targets.shape)).astype(jnp.float32)
        return -jnp.sum(jnp.where(real, picked, 0.0)) / count

    def objective(self, tokens, targets, carry, *, key, length):
        logits, carry = self._logits(tokens, carry, length)
        scale = (jax.random.key_data(key)[-1] % 64).astype(jnp.float32) / 256.0
        logits = logits * (1.0 + scale)
        nll = self._mean_nll(logits, targets, length)
        return nll, Aux(nll, carry)

    def nll(self, tokens, targets, carry, *, length):
        logits, carry = self._logits(tokens, carry, length)
        return self._mean_nll(logits, targets, length), carry

    def log_probs(self, tokens, carry, *, length):
        logits, carry = self._logits(tokens, carry, length)
        return jax.nn.log_softmax(logits), carry


def _corpus() -> TokenizedCorpus:
    """A noisy cycle over the vocabulary: something to learn, in a few epochs."""
    rng = np.random.default_rng(0)

    def stream(n: int) -> np.ndarray:
        ids = np.arange(n) % VOCAB
        noise = rng.random(n) < 0.2
        return np.where(noise, rng.integers(0, VOCAB, n), ids).astype(np.int32)

    words = Vocabulary([f"w{i}" for i in range(VOCAB)])
    return TokenizedCorpus(words, stream(240), stream(60), stream(41), name="toy")


DATA = DataConfig(
    batch_size=4, eval_batch_size=2, bptt=4, seq_len_std=1.0, min_seq_len=2, max_seq_len_delta=2,
    seq_len_bucket=8,
)  # fmt: skip
EVALUATION = EvaluationConfig(test_batch_size=2, logprob_block_tokens=16, max_logprob_tokens=30)


@dataclasses.dataclass(frozen=True)
class Config:
    data: DataConfig = DATA
    training: TrainingConfig = TrainingConfig(epochs=4)
    evaluation: EvaluationConfig = EVALUATION
    stateful: bool = True
    optimizer: str = "sgd"
    seed: int = 3
    out_dir: str = ""


def _trainer(config: Config) -> Trainer:
    if config.optimizer == "sgd":
        tx = optax.sgd(2.0)
    else:  # what a Transformer trains with: AdamW, linear warmup, cosine decay
        schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 5, 60)
        tx = optax.adamw(schedule, weight_decay=0.01)
    return Trainer(TableModel(stateful=config.stateful), tx, seed=config.seed)


def _run(
    config: Config,
    trainer: Trainer | None = None,
    corpus: TokenizedCorpus | None = None,
) -> dict[str, Any]:
    finetune = config.training.finetune_from is not None
    policy = NtAsgd(nonmono=1, finetune=finetune) if config.optimizer == "sgd" else KeepBest()
    with open_session(config.out_dir, config, may_change=("training.epochs",)) as session:
        run = LanguageModelRun(
            trainer or _trainer(config),
            corpus or _corpus(),
            session,
            data=config.data,
            training=config.training,
            evaluation=config.evaluation,
            policy=policy,
            seed=config.seed,
        )
        return train_and_evaluate(run, describe={"model": "table"})


def _metrics(out) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _epochs(out) -> list[dict[str, Any]]:
    return [m for m in _metrics(out) if m["event"] == "epoch"]


def _num_windows(config: Config, epoch: int) -> int:
    batched = np.zeros((len(_corpus().train) // config.data.batch_size, 1))
    return sum(1 for _ in config.data.train_windows(batched, epoch, config.seed))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Four uninterrupted epochs of the stateful model with SGD and NT-ASGD."""
    out = tmp_path_factory.mktemp("reference")
    return out, _run(Config(out_dir=str(out)))


def test_epochs_write_metrics_checkpoints_and_results(reference):
    out, results = reference
    epochs = _epochs(out)
    assert [m["epoch"] for m in epochs] == [1, 2, 3, 4]
    assert [m["event"] for m in _metrics(out)][-1] == "test"
    assert epochs[0]["valid_loss"] < np.log(VOCAB)  # better than uniform
    # nonmono 1: averaging starts after the first epoch that does not improve (here one does).
    (switch,) = [m["epoch"] for m in epochs if m["switched_to_asgd"]]
    assert results["asgd_switch_epoch"] == switch
    assert [m["averaged"] for m in epochs] == [m["epoch"] > switch for m in epochs]
    assert results["model"] == "table" and results["epochs_trained"] == 4
    assert results["stop_reason"] == "epoch budget (4)"
    assert results["tokens_used"] == {"train": 240, "validation": 60, "test": 41}
    assert results["data"]["corpus"] == "toy" and not results["data"]["matches_release"]
    assert (out / "vocab.txt").read_text().splitlines() == [f"w{i}" for i in range(VOCAB)]
    assert json.loads((out / "results.json").read_text())["test_loss"] == results["test_loss"]
    # The best model is evaluated: its validation loss is the best epoch's.
    np.testing.assert_allclose(
        results["valid_loss"], min(m["valid_loss"] for m in epochs), rtol=1e-6
    )
    # Log-probs: 30 rows (max_logprob_tokens) in blocks of 16, in (window, time, sequence) order
    # at test batch 2, whatever the model's layout.
    assert results["log_probs"]["rows"] == 30 and results["log_probs"]["files"] == 2
    targets = np.load(out / "log_prob_targets.npy")
    np.testing.assert_array_equal(targets, batchify(_corpus().test, 2)[1:].reshape(-1)[:30])
    assert len(list((out / "checkpoints").iterdir())) >= 1


def test_the_step_rate_leaves_compiling_out(reference):
    """An epoch's seconds are its wall time; its tokens/s count the steps alone, not the
    compiles of the first epoch's new window shapes (which made a first epoch read "2 tok/s")."""
    out, _ = reference
    config, epochs = Config(), _epochs(out)
    assert epochs[0]["compile_seconds"] > 0
    assert all(0 <= m["compile_seconds"] < m["seconds"] for m in epochs)
    batched = np.zeros((len(_corpus().train) // config.data.batch_size, 1))
    for m in epochs:
        windows = config.data.train_windows(batched, m["epoch"] - 1, config.seed)
        tokens = sum(w.seq_len for w in windows) * config.data.batch_size
        rate = tokens / (m["seconds"] - m["compile_seconds"])
        np.testing.assert_allclose(m["tokens_per_second"], rate, rtol=1e-6)


def test_a_stop_signal_saves_mid_epoch_and_the_rerun_is_the_uninterrupted_run(
    reference, tmp_path, capsys
):
    show_logs()  # as the scripts do
    config = Config(out_dir=str(tmp_path))
    trainer = _trainer(config)
    step, calls = trainer.window_step, []
    stop_at = _num_windows(config, 0) + 2  # the second window of epoch 2

    def signalling_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args, **kwargs)

    trainer.window_step = signalling_step
    with pytest.raises(TrainingInterrupted) as interrupted:
        _run(config, trainer)
    assert interrupted.value.exit_code == 128 + signal.SIGTERM
    assert "SIGTERM received" in capsys.readouterr().err
    assert [m["epoch"] for m in _epochs(tmp_path)] == [1]
    assert not (tmp_path / "results.json").exists()

    results = _run(config)
    assert "at epoch 2, window 2" in capsys.readouterr().err
    got, want = _epochs(tmp_path), _epochs(reference[0])
    # Windows, noise keys and the carry depend on (seed, epoch, step) and the checkpoint only.
    for key in ("train_loss", "valid_loss", "best_valid_ppl", "step", "averaged"):
        np.testing.assert_allclose([m[key] for m in got], [m[key] for m in want], rtol=1e-6)
    np.testing.assert_allclose(results["test_loss"], reference[1]["test_loss"], rtol=1e-6)


def test_a_diverged_run_stops_before_saving_and_its_last_checkpoint_resumes(tmp_path):
    config = Config(out_dir=str(tmp_path), training=TrainingConfig(epochs=2))
    trainer = _trainer(config)
    step, calls = trainer.window_step, []
    first_epoch = _num_windows(config, 0)

    def nan_in_epoch_2(*args, **kwargs):  # as a too large learning rate would make it
        calls.append(1)
        carry, metrics = step(*args, **kwargs)
        return carry, metrics._replace(
            nll=metrics.nll * (np.nan if len(calls) > first_epoch else 1)
        )

    trainer.window_step = nan_in_epoch_2
    with pytest.raises(TrainingDiverged, match="became nan in epoch 2") as error:
        _run(config, trainer)
    assert "the checkpoint of epoch 1 is kept" in str(error.value)
    assert not (tmp_path / "results.json").exists()  # no perplexity of a broken model
    assert [m["epoch"] for m in _metrics(tmp_path)] == [1]

    results = _run(config)  # the kept checkpoint resumes
    assert results["epochs_trained"] == 2 and np.isfinite(results["test_loss"])


def test_a_stateless_model_with_adamw_and_a_schedule_keeps_the_best_and_stops_early(tmp_path):
    evaluation = dataclasses.replace(
        EVALUATION, dynamic_eval=True, dynamic_eval_segment=3, dynamic_eval_batch_size=2,
        dynamic_eval_max_batches=2,
    )  # fmt: skip
    config = Config(
        out_dir=str(tmp_path), stateful=False, optimizer="adamw", evaluation=evaluation,
        training=TrainingConfig(epochs=3, patience=1),
    )  # fmt: skip
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam is not strict-promotion clean
        results = _run(config)
    epochs = _epochs(tmp_path)
    assert not any(m["averaged"] or m["switched_to_asgd"] for m in epochs)
    assert len(epochs) <= 3 and results["stop_reason"] in (
        "epoch budget (3)",
        "early stopping (no improvement for 1 epochs)",
    )
    assert epochs[-1]["valid_loss"] < np.log(VOCAB)
    assert set(results["dynamic_eval"]) >= {"valid_ppl", "test_ppl", "lr", "lamb", "style"}
    targets = np.load(tmp_path / "log_prob_targets.npy")
    log_probs = np.concatenate([np.load(f) for f in sorted((tmp_path / "log_probs").iterdir())])
    np.testing.assert_allclose(np.exp(log_probs).sum(axis=1), 1.0, rtol=1e-5)
    assert log_probs.shape == (30, VOCAB) and targets.shape == (30,)

    # A learning rate of 0 never improves: patience 1 stops after the second epoch.
    frozen = tmp_path / "frozen"
    frozen_config = dataclasses.replace(config, out_dir=str(frozen), evaluation=EVALUATION)
    trainer = Trainer(TableModel(stateful=False), optax.sgd(0.0))
    results = _run(frozen_config, trainer)
    assert [m["epoch"] for m in _epochs(frozen)] == [1, 2]
    assert _epochs(frozen)[-1].get("early_stop")
    assert results["stop_reason"] == "early stopping (no improvement for 1 epochs)"


def test_finetuning_starts_from_the_best_model_and_averages(reference, tmp_path):
    source, source_results = reference
    config = Config(
        out_dir=str(tmp_path), training=TrainingConfig(epochs=2, finetune_from=str(source))
    )
    _run(config)
    epochs = _epochs(tmp_path)
    assert [(m["stage"], m["averaged"]) for m in epochs] == [("finetune", True)] * 2
    assert epochs[0]["best_valid_ppl"] <= source_results["valid_ppl"] * (1 + 1e-6)

    empty = tmp_path / "empty"
    with pytest.raises(UsageError, match="no checkpoint in"):
        _run(dataclasses.replace(config, out_dir=str(tmp_path / "other"),
                                 training=TrainingConfig(finetune_from=str(empty))))  # fmt: skip


def test_resuming_with_another_config_is_refused(reference):
    out, _ = reference
    with pytest.raises(UsageError, match=r"different config \(seed: 3 -> 4\)"):
        _run(Config(out_dir=str(out), seed=4))
    with pytest.raises(UsageError, match=r"data.batch_size: 4 -> 2"):
        _run(Config(out_dir=str(out), data=dataclasses.replace(DATA, batch_size=2)))
    # The same config on other data files: the checkpoint's ids would mean other words.
    renamed = _corpus()._replace(vocabulary=Vocabulary([f"v{i}" for i in range(VOCAB)]))
    with pytest.raises(UsageError, match="vocab.txt differs from the corpus's vocabulary of 8"):
        _run(Config(out_dir=str(out)), corpus=renamed)
    assert (out / "vocab.txt").read_text().splitlines()[0] == "w0"


def test_early_stopping_and_stop_reasons():
    training = TrainingConfig(epochs=5, patience=2)
    records = [{"valid_loss": v} for v in (5.0, 4.0, 4.5)]
    assert epochs_since_best(records) == 1
    assert epochs_since_best([*records, {"valid_loss": 4.2}]) == 2
    assert epochs_since_best([*records, {"valid_loss": 3.0}]) == 0
    status = NtAsgdStatus()
    assert stop_reason(records, status, training) == "running"
    stopped = [*records, {"valid_loss": 4.2, "early_stop": True}]
    assert stop_reason(stopped, status._replace(finished=True), training) == (
        "early stopping (no improvement for 2 epochs)"
    )
    full = [{"valid_loss": 1.0 - i / 10} for i in range(5)]
    assert stop_reason(full, status, training) == "epoch budget (5)"
    finetuned = status._replace(finished=True)
    assert stop_reason(records, finetuned, training) == "finetune criterion (NT-ASGD)"
