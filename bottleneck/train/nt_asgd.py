"""NT-ASGD: non-monotonically triggered averaged SGD (Merity et al. 2017, Sec. 3 and Alg. 1).

Train with plain SGD; once the validation loss has not improved on the best value from more than
``nonmono`` evaluations ago, switch to averaged SGD: keep stepping with SGD, but keep the running
average of the iterates from the switch on and evaluate (and checkpoint) the average. The
finetune stage of AWD-LSTM restarts averaging from the best model and stops on the same trigger.

Both pieces are pure; the training loop owns the validation history and the switch flag.
:class:`NtAsgd` is the epoch-level rule as one :class:`EpochPolicy` of the run loop
(:mod:`bottleneck.runs.run_loop`); :class:`KeepBest` is the one for optimizers that never average.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp


def should_switch_to_averaging(val_history: Sequence[float], val_loss: float, nonmono: int) -> bool:
    """The non-monotone trigger: ``len(history) > n`` and ``val_loss > min(history[:-n])``.

    Exactly the condition of AWD-LSTM's ``main.py`` (checked before ``val_loss`` is appended to
    the history): the new loss is worse than the best loss of the epochs older than the last
    ``nonmono`` ones. ``finetune.py`` stops training on the same condition.

    Args:
      val_history: validation losses of the previous evaluations, oldest first.
      val_loss: the loss just measured (not yet in ``val_history``).
      nonmono: ``n``, the patience in evaluations (5 in Merity et al.).

    Example:
      >>> should_switch_to_averaging([5.0, 4.0, 3.9, 3.95, 3.96, 3.97], 4.1, nonmono=3)
      True
      >>> should_switch_to_averaging([5.0, 4.0, 3.9, 3.95, 3.96, 3.97], 3.85, nonmono=3)
      False
      >>> should_switch_to_averaging([5.0, 4.0, 3.9, 3.95, 3.96, 3.97], 4.1, nonmono=6)
      False
    """
    if nonmono < 1:
        raise ValueError(f"nonmono must be >= 1, got {nonmono}")
    return len(val_history) > nonmono and val_loss > min(val_history[:-nonmono])


def update_average(average: Any, params: Any, num_averaged: jax.Array | int) -> Any:
    r"""Running mean of the iterates: ``avg + (params - avg) / (n + 1)``.

    After iterates :math:`\theta_1, \dots, \theta_{n+1}` (``num_averaged = n`` before the call)
    the result is :math:`\frac{1}{n+1}\sum_{i=1}^{n+1}\theta_i`; with ``n = 0`` it is
    ``params`` itself, as PyTorch's ``ASGD(t0=0, lambd=0)`` used by AWD-LSTM.

    Args:
      average: pytree, the mean of the first ``n`` iterates (anything when ``n = 0``).
      params: pytree of the same structure, the new iterate.
      num_averaged: ``n``, int scalar.
    """
    count = jnp.asarray(num_averaged, jnp.int32) + 1

    def step(avg: jax.Array, p: jax.Array) -> jax.Array:
        return avg + (p - avg) / count.astype(avg.dtype)

    return jax.tree.map(step, average, params)


class NtAsgdStatus(NamedTuple):
    """The epoch-level bookkeeping of NT-ASGD (JSON-friendly: floats, bools, a tuple).

    Attributes:
      val_history: validation losses that the trigger looks back on, oldest first.
      best_val_loss: the lowest validation loss so far (``inf`` before the first).
      averaging: averaging has started (ASGD phase, or a finetune run from the start).
      finished: a finetune run met its stopping criterion.
    """

    val_history: tuple[float, ...] = ()
    best_val_loss: float = math.inf
    averaging: bool = False
    finished: bool = False


class EpochOutcome(NamedTuple):
    """What :func:`end_of_epoch` decided: the new status and what the caller must act on.

    Attributes:
      status: the updated :class:`NtAsgdStatus`.
      improved: the evaluated parameters are the new best (save them as the best model).
      switched: averaging starts now (reset the average).
    """

    status: NtAsgdStatus
    improved: bool
    switched: bool


def end_of_epoch(
    status: NtAsgdStatus,
    val_loss: float,
    *,
    nonmono: int,
    finetune: bool = False,
    can_switch: bool = True,
) -> EpochOutcome:
    """One epoch's NT-ASGD decisions, as AWD-LSTM's ``main.py`` and ``finetune.py``.

    ``val_loss`` is the validation loss of the parameters that are evaluated: the iterate
    before averaging, the average after.

    * Before averaging: a new best is kept; if ``can_switch`` (plain SGD) and the trigger
      :func:`should_switch_to_averaging` fires, averaging starts; ``val_loss`` joins the history.
    * While averaging: a new best is kept. A finetune run (``finetune=True``; it averages from
      its first epoch) stops when the same trigger fires, and appends to the history; the
      averaging phase of a training run no longer looks at the history.

    Example:
      >>> status = NtAsgdStatus(val_history=(5.0, 4.0, 3.9, 3.95, 3.96, 3.97), best_val_loss=3.9)
      >>> end_of_epoch(status, 4.1, nonmono=3).switched
      True
    """
    improved = val_loss < status.best_val_loss
    best = min(val_loss, status.best_val_loss)
    triggered = should_switch_to_averaging(status.val_history, val_loss, nonmono)
    if status.averaging:
        if not finetune:
            return EpochOutcome(status._replace(best_val_loss=best), improved, False)
        history = (*status.val_history, val_loss)
        new = status._replace(val_history=history, best_val_loss=best, finished=triggered)
        return EpochOutcome(new, improved, False)
    switched = can_switch and triggered
    history = (*status.val_history, val_loss)
    new = NtAsgdStatus(history, best, switched, False)
    return EpochOutcome(new, improved, switched)


class EpochPolicy(Protocol):
    """An optimizer's decisions after each epoch's validation, as the run loop asks for them.

    Given the status and the validation loss of the evaluated parameters, returns the new
    status (best loss, history; ``averaging``: fold every later iterate into the average and
    evaluate that; ``finished``: stop training) and whether the parameters are the new best.
    """

    def end_of_epoch(self, status: NtAsgdStatus, val_loss: float) -> EpochOutcome: ...


@dataclasses.dataclass(frozen=True)
class NtAsgd:
    """NT-ASGD as an :class:`EpochPolicy` (:func:`end_of_epoch`): SGD until the trigger, then
    averaged SGD; with ``finetune``, the finetune stage's stopping rule (the run averages from
    its first step)."""

    nonmono: int = 5
    finetune: bool = False

    def end_of_epoch(self, status: NtAsgdStatus, val_loss: float) -> EpochOutcome:
        return end_of_epoch(status, val_loss, nonmono=self.nonmono, finetune=self.finetune)


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """The :class:`EpochPolicy` of optimizers that do not average (Adam, AdamW with a learning
    rate schedule): every epoch's iterate is evaluated and the best one kept; training runs for
    its epochs (or until the run loop's early stopping).

    Example:
      >>> KeepBest().end_of_epoch(NtAsgdStatus(best_val_loss=4.0), 3.5).improved
      True
    """

    def end_of_epoch(self, status: NtAsgdStatus, val_loss: float) -> EpochOutcome:
        new = status._replace(
            val_history=(*status.val_history, val_loss),
            best_val_loss=min(val_loss, status.best_val_loss),
        )
        return EpochOutcome(new, val_loss < status.best_val_loss, False)
