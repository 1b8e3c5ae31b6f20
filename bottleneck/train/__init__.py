"""Training and experiment plumbing shared by every experiment script.

The trainer (:class:`Trainer`: its :class:`TrainState` and pure steps :func:`train_step`,
:func:`window_step`, :func:`eval_step`, :func:`log_probs_step`) and its optimizer
(:func:`make_optimizer`); the language-model run loop (:func:`train_and_evaluate`) and the parts
of its config (:class:`DataConfig`, :class:`HeadConfig`, :class:`OptimizerConfig`,
:class:`TrainingConfig`, :class:`EvaluationConfig`); the scripts' command line
(:func:`parse_config`, :class:`Checked` configs), run folders (:func:`open_run`, :class:`RunDir`),
tables and results pages (:func:`results_page`). The rest stays in the submodules.
"""

from bottleneck.train.experiment import Checked, markdown_table, parse_config, progress
from bottleneck.train.lm_config import (
    DataConfig,
    EvaluationConfig,
    HeadConfig,
    OptimizerConfig,
    TrainingConfig,
)
from bottleneck.train.run_folder import (
    RunDir,
    RunFolderError,
    TrainingInterrupted,
    UsageError,
    code_commit,
    open_run,
    results_page,
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
    "Checked",
    "DataConfig",
    "EvaluationConfig",
    "HeadConfig",
    "OptimizerConfig",
    "RunDir",
    "RunFolderError",
    "TrainState",
    "Trainer",
    "TrainingConfig",
    "TrainingInterrupted",
    "UsageError",
    "code_commit",
    "eval_step",
    "log_probs_step",
    "make_optimizer",
    "markdown_table",
    "open_run",
    "parse_config",
    "progress",
    "results_page",
    "train_and_evaluate",
    "train_step",
    "window_step",
]
