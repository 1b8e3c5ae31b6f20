"""The language-model run loop, for any model: train, checkpoint, resume, stop, evaluate.

:func:`train_and_evaluate` runs one experiment in a run folder opened with :func:`open_session`:

1. resume from the folder's latest checkpoint, or start a finetune stage from another run's best
   model (``TrainingConfig.finetune_from``), or start afresh;
2. train epoch by epoch: windows from :meth:`DataConfig.train_windows` (a function of the seed
   and the epoch), one :meth:`~bottleneck.train.Trainer.window_step` each; after every epoch, validate
   the evaluated parameters (the iterate, or its average once the policy averages), let the
   :class:`~bottleneck.train.nt_asgd.EpochPolicy` decide (NT-ASGD switches to averaging and
   stops a finetune stage; :class:`~bottleneck.train.nt_asgd.KeepBest` only keeps the best),
   keep the best parameters, stop early after ``patience`` epochs without improvement, append
   one line to ``metrics.jsonl`` and write a checkpoint;
3. evaluate the best parameters: validation and test perplexity, the test log-probabilities
   (``log_probs/``) and, if asked, dynamic evaluation; write ``results.json``.

The model is anything that :class:`~bottleneck.train.Trainer` trains by windows, that is an
``nnx.Module`` with these methods (:class:`bottleneck.train.lm.LanguageModel`), all on batch-major
token ids ``[B, T]`` padded after ``length`` (an int32 scalar) real steps:

* ``initial_carry(batch_size)``: the state carried from one window to the next (truncated BPTT),
  a pytree of batch-leading arrays, or ``None`` for a stateless model (a Transformer);
* ``objective(tokens, targets, carry, *, key, length) -> (loss, aux)``: the training loss with
  dropout from ``key``; ``aux.nll`` is its mean NLL, ``aux.carry`` the next carry;
* ``nll(tokens, targets, carry, *, length) -> (mean_nll, carry)``: deterministic, for evaluation
  and dynamic evaluation;
* ``log_probs(tokens, carry, *, length) -> (log_probs [B, T, M], carry)``: deterministic.

The optimizer is the trainer's optax transformation (a schedule such as warmup + cosine decay
lives inside it, keyed by the step count that checkpoints keep) with its epoch policy; a model
family plugs in with a model builder and an optimizer choice, nothing here.

Resuming. A checkpoint holds the trainer's state (parameters, optimizer state, average, step),
the best parameters, the carry, and the loop's bookkeeping (epoch, window in it, policy status,
partial sums, every epoch's record); dropout keys and window lengths are functions of (seed,
epoch, step), so a resumed run continues as if never stopped. :func:`open_session` refuses a
folder whose checkpointed run had another config, but for the fields it is told may change.
On SIGINT / SIGTERM the run finishes its step, saves and raises :class:`TrainingInterrupted`
(scripts exit with its status, 128 + signal); a
training loss that turns NaN or infinite stops it with :class:`TrainingDiverged` before anything
of the broken epoch is saved; a checkpoint that cannot be written (a full disk) stops it with
:class:`~bottleneck.runs.checkpoint.CheckpointWriteError`, the last complete checkpoint kept.

Writes to the run folder: config.json, vocab.txt (the vocabulary, one token per line in id
order: what a model's ids mean, for sampling without the corpus; a resumed run whose corpus
gives another vocabulary is refused), metrics.jsonl (one line per epoch: train loss,
validation perplexity, seconds, tokens/s; a final "test" line), results.json,
log_probs/block_*.npy (test log-probabilities [T_i, M], float32, one row per test token in
evaluation order: window, time step, sequence), log_prob_targets.npy (the rows' target ids) and
checkpoints/ (each array by its parameter path, such as ``best_params/model/head/bias/value``:
:func:`~bottleneck.runs.checkpoint.checkpoint_contents` lists them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bottleneck.data import BpttWindow, TokenizedCorpus, Vocabulary, batchify
from bottleneck.runs.checkpoint import CheckpointStore
from bottleneck.runs.cli import progress
from bottleneck.runs.folder import (
    RunDir,
    RunLock,
    StopSignals,
    TrainingInterrupted,
    UsageError,
    check_resumable,
    check_run_folder,
    open_run,
    to_jsonable,
)
from bottleneck.runs.lm_config import DataConfig, EvaluationConfig, TrainingConfig
from bottleneck.train.lm import (
    LogProbBlockWriter,
    eval_windows,
    num_eval_windows,
)
from bottleneck.train.nt_asgd import EpochOutcome, EpochPolicy, NtAsgdStatus
from bottleneck.train.steps import Trainer

logger = logging.getLogger(__name__)


# jax.monitoring's duration events of tracing, lowering and XLA's compile (jax._src.dispatch).
_COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)
_compiled = [0.0]  # seconds, summed by the listener
# An epoch's sums before its first step (checkpointed as they grow, so that it resumes).
NO_PARTIAL_EPOCH = {"nll_sum": 0.0, "tokens": 0, "seconds": 0.0, "compile_seconds": 0.0}


@functools.cache
def _listen_to_compiles() -> None:
    def listener(event: str, seconds: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            _compiled[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(listener)


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling JAX functions since the
    first call (jax.monitoring's duration events): what a step rate leaves out."""
    _listen_to_compiles()
    return _compiled[0]


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite (scripts exit with status 1)."""


@dataclasses.dataclass(frozen=True)
class Session:
    """A run folder held by this process: its files, checkpoints and the stop signals."""

    run: RunDir
    store: CheckpointStore
    stop: StopSignals


@contextlib.contextmanager
def open_session(
    out_dir: str | Path, config: Any, *, may_change: Collection[str] = ()
) -> Iterator[Session]:
    """Takes ``out_dir`` for one run of ``config`` (:class:`Session`); releases it on exit.

    In this order, so that a refused folder is left as it was: the folder must be this
    experiment's (:func:`~bottleneck.runs.folder.check_run_folder`), no other process may
    hold it (:class:`~bottleneck.runs.folder.RunLock`), and a checkpointed run in it must
    have the same config but for the fields in ``may_change``
    (:func:`~bottleneck.runs.folder.check_resumable`); then ``config.json`` is written
    (``metrics.jsonl`` is kept when resuming). Each refusal is a
    :class:`~bottleneck.runs.folder.RunFolderError`.
    """
    root = check_run_folder(out_dir, config)
    with RunLock(root), CheckpointStore(root / "checkpoints") as store, StopSignals() as stop:
        resuming = store.latest_step() is not None
        if resuming:
            check_resumable(root, config, may_change)
        yield Session(open_run(root, config, resume=resuming), store, stop)


VOCABULARY_FILE = "vocab.txt"


def record_vocabulary(run: RunDir, vocabulary: Vocabulary, *, resuming: bool) -> None:
    """Writes ``vocab.txt``; when ``resuming``, a ``vocab.txt`` already there must be
    ``vocabulary`` (:class:`~bottleneck.runs.folder.UsageError` otherwise): the checkpoint's
    token ids mean nothing with another one."""
    path = run.path(VOCABULARY_FILE)
    if resuming and path.is_file() and Vocabulary.read(path).tokens != vocabulary.tokens:
        raise UsageError(
            f"{path} differs from the corpus's vocabulary of {len(vocabulary)}: the run was "
            "trained on other data files; restore them or choose another --out_dir"
        )
    vocabulary.write(path)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def epochs_since_best(records: list[dict[str, Any]]) -> int:
    """Epochs since the lowest validation loss in ``records`` (0: the last epoch is the best)."""
    losses = [record["valid_loss"] for record in records]
    return len(losses) - 1 - int(np.argmin(losses))


def stop_reason(
    records: list[dict[str, Any]], status: NtAsgdStatus, training: TrainingConfig
) -> str:
    """Why training ended (or ``"running"``): early stopping, the policy's rule, the budget."""
    if any(record.get("early_stop") for record in records):
        return f"early stopping (no improvement for {training.patience} epochs)"
    if status.finished:
        return "finetune criterion (NT-ASGD)"
    if len(records) >= training.epochs:
        return f"epoch budget ({training.epochs})"
    return "running"


class Ticker:
    """A progress bar advanced once per window that stops the run on a pending signal."""

    def __init__(self, stop: StopSignals, total: int, desc: str):
        self.stop, self.bar = stop, progress(None, total=total, desc=desc)

    def __call__(self) -> None:
        self.bar.update(1)
        if self.stop.requested:  # nothing to save: the final evaluation is redone on resume
            raise TrainingInterrupted(self.stop.exit_code)

    def __enter__(self) -> Ticker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bar.close()


class LanguageModelRun:
    """One training run: the trainer, its bookkeeping, checkpoints and metrics, which
    :func:`train_and_evaluate` drives.

    Args:
      trainer: the model and its optimizer (freshly initialised: a checkpoint or a finetune
        source replaces its state).
      corpus: the token ids of the three splits.
      session: from :func:`open_session`.
      data, training, evaluation: the config's parts.
      policy: the optimizer's epoch policy (NT-ASGD, keep-best, ...).
      seed: of the training windows' lengths.
    """

    def __init__(
        self,
        trainer: Trainer,
        corpus: TokenizedCorpus,
        session: Session,
        *,
        data: DataConfig,
        training: TrainingConfig,
        evaluation: EvaluationConfig,
        policy: EpochPolicy,
        seed: int,
    ):
        self.trainer, self.corpus = trainer, corpus
        self.data, self.training, self.evaluation = data, training, evaluation
        self.policy, self.seed = policy, seed
        self.run, self.store, self.stop = session.run, session.store, session.stop
        self.train_batched = batchify(corpus.train, data.batch_size)
        self.val_batched = batchify(corpus.validation, data.eval_batch_size)
        if self.train_batched.shape[0] < 3 or self.val_batched.shape[0] < 2:
            raise UsageError(
                f"corpus too small for batch_size {data.batch_size} / eval_batch_size "
                f"{data.eval_batch_size}: train {self.train_batched.shape}, validation "
                f"{self.val_batched.shape} after batchify"
            )
        # Copies: the training steps donate (and so delete) the state's own arrays.
        self.best_params = jax.tree.map(jnp.copy, trainer.state.params)
        self.status = NtAsgdStatus()
        self.epoch = 0  # completed epochs
        self.window = 0  # windows done in the current epoch
        self.carry = trainer.initial_carry(data.batch_size)
        self.partial = dict(NO_PARTIAL_EPOCH)
        self.records: list[dict[str, Any]] = []
        self.saved_step: int | None = None

    @property
    def finished(self) -> bool:
        return self.epoch >= self.training.epochs or self.status.finished

    # -- checkpoints -------------------------------------------------------------------------

    def _items(self) -> dict[str, Any]:
        items = {"state": self.trainer.state, "best_params": self.best_params}
        if self.carry is not None:  # a stateless model carries nothing between windows
            items["carry"] = self.carry
        return items

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
        self.best_params, self.carry = items["best_params"], items.get("carry")
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
        if self.finished:
            logger.info(
                "resumed %s: training is complete, evaluating its best model", self.run.root
            )
        else:
            logger.info(
                "resumed %s at epoch %d, window %d", self.run.root, self.epoch + 1, self.window
            )
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
        val_loss = self.trainer.evaluate(params, self.val_batched, self.data.bptt)
        self.best_params = params
        self.status = NtAsgdStatus(best_val_loss=val_loss, averaging=True)
        logger.info(
            "finetuning %s: its best model has validation perplexity %.2f",
            source,
            perplexity(val_loss),
        )

    # -- training ------------------------------------------------------------------------------

    def train(self) -> None:
        """Trains until the epoch budget ends or the policy or early stopping ends training."""
        while not self.finished:
            self._train_epoch()
            eval_params = (
                self.trainer.state.average if self.status.averaging else self.trainer.state.params
            )
            start = time.perf_counter()
            val_loss = self.trainer.evaluate(eval_params, self.val_batched, self.data.bptt)
            val_seconds = time.perf_counter() - start
            outcome = self.policy.end_of_epoch(self.status, val_loss)
            if outcome.improved:
                self.best_params = jax.tree.map(jnp.copy, eval_params)
            if outcome.switched:  # the average starts from the next iterate
                self.trainer.state = self.trainer.state._replace(
                    num_averaged=jnp.zeros((), jnp.int32)
                )
            record = self._epoch_record(val_loss, val_seconds, outcome)
            self.status = outcome.status
            self.records.append(record)
            patience = self.training.patience
            if patience is not None and epochs_since_best(self.records) >= patience:
                record["early_stop"] = True
                self.status = self.status._replace(finished=True)
            self.epoch, self.window = self.epoch + 1, 0
            self.carry = self.trainer.initial_carry(self.data.batch_size)
            self.partial = dict(NO_PARTIAL_EPOCH)
            self.save()
            self.run.log_metrics(record)
            seconds, compiling = record["seconds"], record["compile_seconds"]
            logger.info(
                f"epoch {record['epoch']:4d} | train ppl {record['train_ppl']:9.2f} | valid ppl "
                f"{record['valid_ppl']:9.2f} | {seconds:7.1f} s"
                f"{f' (compiling {compiling:.1f} s)' if compiling >= 0.05 else ''} | "
                f"{record['tokens_per_second']:8.0f} tok/s{' | ASGD' if self.status.averaging else ''}"
                f"{' (switched)' if outcome.switched else ''}"
            )
            if self.stop.requested:
                raise TrainingInterrupted(self.stop.exit_code)
            if self.status.finished:
                reason = stop_reason(self.records, self.status, self.training)
                logger.info("%s: training stops", reason)

    def _epoch_record(self, val_loss: float, val_seconds: float, outcome: EpochOutcome) -> dict:
        """The epoch's line of metrics.jsonl (before the early-stopping mark)."""
        seconds = self.partial["seconds"]
        compiling = self.partial.get("compile_seconds", 0.0)
        train_loss = self.partial["nll_sum"] / max(self.partial["tokens"], 1)
        return {
            "event": "epoch",
            "stage": "train" if self.training.finetune_from is None else "finetune",
            "epoch": self.epoch + 1,
            "step": int(self.trainer.state.step),
            "train_loss": train_loss,
            "train_ppl": perplexity(train_loss),
            "valid_loss": val_loss,
            "valid_ppl": perplexity(val_loss),
            "best_valid_ppl": perplexity(outcome.status.best_val_loss),
            "averaged": self.status.averaging,
            "switched_to_asgd": outcome.switched,
            "seconds": seconds,  # wall time of the epoch's steps, compiling included
            "compile_seconds": compiling,
            # the steps' own rate: a first epoch's compiles would understate it many times
            "tokens_per_second": self.partial["tokens"] / max(seconds - compiling, 1e-9),
            "valid_seconds": val_seconds,
        }

    def _windows(self) -> Iterator[BpttWindow]:
        return self.data.train_windows(self.train_batched, self.epoch, self.seed)

    def _train_epoch(self) -> None:
        batch = self.data.batch_size
        total = sum(1 for _ in self._windows())
        bar = progress(
            itertools.islice(self._windows(), self.window, None),
            total=total - self.window,
            desc=f"epoch {self.epoch + 1}/{self.training.epochs}",
        )
        nll_sum, tokens = jnp.float32(self.partial["nll_sum"]), int(self.partial["tokens"])
        start, compiled_before = time.perf_counter(), compile_seconds()

        def keep_partial() -> None:
            self.partial = {
                "nll_sum": float(nll_sum),
                "tokens": tokens,
                "seconds": self.partial["seconds"] + time.perf_counter() - start,
                "compile_seconds": self.partial.get("compile_seconds", 0.0)
                + compile_seconds()
                - compiled_before,
            }

        steps = self.trainer.train_windows(
            self.carry, bar, bucket=self.data.seq_len_bucket, averaging=self.status.averaging
        )
        for self.carry, window, metrics in steps:
            nll_sum = nll_sum + metrics.nll * (window.seq_len * batch)
            tokens += window.seq_len * batch
            self.window += 1
            if self.window % 10 == 0:
                loss = float(nll_sum) / tokens
                self._check_finite(loss)
                bar.set_postfix(loss=f"{loss:.3f}", ppl=f"{perplexity(loss):.1f}")
            if self.stop.requested:  # the step is done: save where we are and leave
                self._check_finite(float(nll_sum) / tokens)  # never checkpoint a diverged state
                keep_partial()
                self.save()
                raise TrainingInterrupted(self.stop.exit_code)
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
                f"{self.window}); nothing of this epoch was saved and {kept}; lower the "
                "learning rate or clip the gradients harder"
            )

    # -- final evaluation ------------------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Validation and test perplexity of the best model, test log-probs, dynamic evaluation."""
        evaluation, params, bptt = self.evaluation, self.best_params, self.data.bptt
        with Ticker(self.stop, num_eval_windows(self.val_batched, bptt), "validation") as tick:
            valid_loss = self.trainer.evaluate(params, self.val_batched, bptt, on_window=tick)
        test_batched = batchify(self.corpus.test, evaluation.test_batch_size)
        writer = None
        if evaluation.max_logprob_tokens != 0:
            writer = LogProbBlockWriter(
                self.run.root / "log_probs",
                block_rows=evaluation.logprob_block_tokens,
                max_rows=evaluation.max_logprob_tokens,
            )
        start = time.perf_counter()
        with Ticker(self.stop, num_eval_windows(test_batched, bptt), "test") as tick:
            test_loss = self.trainer.evaluate(
                params, test_batched, bptt, writer=writer, on_window=tick
            )
        test_seconds = time.perf_counter() - start
        seconds = [record["seconds"] for record in self.records]
        results: dict[str, Any] = {
            "num_params": sum(int(np.size(x)) for x in jax.tree.leaves(params)),
            "epochs_trained": self.epoch,
            "stop_reason": stop_reason(self.records, self.status, self.training),
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
        if evaluation.dynamic_eval:
            results["dynamic_eval"] = self.dynamic_eval(params)
        return results

    def dynamic_eval(self, params: Any) -> dict[str, Any]:
        """Dynamic evaluation of ``params`` on the validation and test streams."""
        evaluation = self.evaluation
        segment = evaluation.dynamic_eval_segment
        stats_batched = batchify(self.corpus.train, evaluation.dynamic_eval_batch_size)
        hyper = {
            "segment": segment,
            "lr": evaluation.dynamic_eval_lr,
            "lamb": evaluation.dynamic_eval_lambda,
            "epsilon": evaluation.dynamic_eval_epsilon,
            "style": evaluation.dynamic_eval_style,
        }
        results: dict[str, Any] = dict(hyper)
        stats = None
        for split, ids in (("valid", self.corpus.validation), ("test", self.corpus.test)):
            batched = batchify(ids, 1)  # one stream, as Krause's and Yang's dynamiceval.py
            total = num_eval_windows(batched, segment)
            if stats is None:  # the training-gradient statistics, once for both splits
                total += min(
                    num_eval_windows(stats_batched, segment),
                    evaluation.dynamic_eval_max_batches or math.inf,
                )
            start = time.perf_counter()
            with Ticker(self.stop, int(total), f"dynamic eval ({split})") as tick:
                loss, stats = self.trainer.dynamic_evaluate(
                    params,
                    eval_windows(stats_batched, segment),
                    batched,
                    stats_batch_size=evaluation.dynamic_eval_batch_size,
                    max_batches=evaluation.dynamic_eval_max_batches,
                    stats=stats,
                    on_window=tick,
                    **hyper,
                )
            results[f"{split}_loss"], results[f"{split}_ppl"] = loss, perplexity(loss)
            results[f"{split}_seconds"] = time.perf_counter() - start
        return results


def train_and_evaluate(lm: LanguageModelRun, describe: Mapping[str, Any]) -> dict[str, Any]:
    """Trains (or resumes, or finetunes) the run ``lm`` and evaluates it; writes and returns the
    results.

    Args:
      lm: the run, freshly built (a checkpoint in its folder, or its finetune source, replaces
        its trainer's state).
      describe: what was trained (e.g. model, head, corpus): the first entries of the results
        (and of the line logged before training).

    Returns:
      ``results.json``'s contents: ``describe``, then the evaluation's results (perplexities,
      ``stop_reason``, ``data`` provenance, ``tokens_used``, ``dynamic_eval``, ...).
    """
    record_vocabulary(lm.run, lm.corpus.vocabulary, resuming=lm.store.latest_step() is not None)
    if not lm.restore() and lm.training.finetune_from is not None:
        lm.start_finetune(lm.training.finetune_from)
    num_params = sum(int(np.size(x)) for x in jax.tree.leaves(lm.trainer.state.params))
    logger.info(
        "%s: vocabulary %d, train %d tokens, %s parameters",
        ", ".join(f"{key} {value}" for key, value in describe.items()),
        len(lm.corpus.vocabulary),
        len(lm.corpus.train),
        f"{num_params:,}",
    )
    lm.train()
    results = {**describe, **lm.evaluate()}
    lm.run.write_json("results.json", results)
    lm.run.log_metrics(
        {"event": "test", **{k: v for k, v in results.items() if not isinstance(v, dict)}}
    )
    return results


def written_files(results: Mapping[str, Any]) -> list[str]:
    """What :func:`train_and_evaluate` wrote into the run folder, for the scripts to report."""
    written = ["results.json", "metrics.jsonl", "config.json", VOCABULARY_FILE, "checkpoints/"]
    return written + (["log_probs/", "log_prob_targets.npy"] if "log_probs" in results else [])
