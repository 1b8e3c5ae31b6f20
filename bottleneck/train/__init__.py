"""Training: the trainer and its pure steps, no files and no command line.

The trainer (:class:`Trainer`: its :class:`TrainState` and pure steps :func:`train_step`,
:func:`window_step`, :func:`eval_step`, :func:`log_probs_step`, bound with jit and donation) and
its optimizer (:func:`make_optimizer`); the epoch policies (NT-ASGD, keep-best) and dynamic
evaluation in the submodules. A run on disk (the language model's run loop and its config's
parts, folders, checkpoints, the command line) is :mod:`bottleneck.runs`'s.
"""

from bottleneck.train.steps import (
    Trainer,
    TrainState,
    eval_step,
    log_probs_step,
    make_optimizer,
    train_step,
    window_step,
)

__all__ = [
    "TrainState",
    "Trainer",
    "eval_step",
    "log_probs_step",
    "make_optimizer",
    "train_step",
    "window_step",
]
