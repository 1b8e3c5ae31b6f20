"""Training: the trainer, its steps, the language model's run loop and its config's parts.

The trainer (:class:`Trainer`: its :class:`TrainState` and pure steps :func:`train_step`,
:func:`window_step`, :func:`eval_step`, :func:`log_probs_step`) and its optimizer
(:func:`make_optimizer`); the language-model run loop (:func:`train_and_evaluate`) and the parts
of its config (:class:`DataConfig`, :class:`HeadConfig`, :class:`OptimizerConfig`,
:class:`TrainingConfig`, :class:`EvaluationConfig`). What a run keeps on disk (its folder,
checkpoints, command line) is :mod:`bottleneck.runs`'s. The rest stays in the submodules.
"""

from bottleneck.train.lm_config import (
    DataConfig,
    EvaluationConfig,
    HeadConfig,
    OptimizerConfig,
    TrainingConfig,
)
from bottleneck.train.run_loop import train_and_evaluate
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
    "DataConfig",
    "EvaluationConfig",
    "HeadConfig",
    "OptimizerConfig",
    "TrainState",
    "Trainer",
    "TrainingConfig",
    "eval_step",
    "log_probs_step",
    "make_optimizer",
    "train_and_evaluate",
    "train_step",
    "window_step",
]
