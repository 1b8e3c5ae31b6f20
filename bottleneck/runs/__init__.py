"""A run on disk: its command line, folder, checkpoints, run loop, and the language model
experiment.

* :mod:`bottleneck.runs.cli`: the checked config base (:class:`Checked`), the scripts' command
  line (:func:`parse_config`, tyro's), the scripts' own errors in one line, tables, progress;
* :mod:`bottleneck.runs.folder`: run folders (:func:`open_run`, :class:`RunDir`: config.json,
  the resume check, the stop signals, the lock, results pages, the code's commit and device);
* :mod:`bottleneck.runs.checkpoint`: Orbax checkpoints of a run;
* :mod:`bottleneck.runs.rows`: every script's results file, upserted by key;
* :mod:`bottleneck.runs.run_loop` and :mod:`bottleneck.runs.lm_config`: the language model's
  run loop (:func:`~bottleneck.runs.run_loop.train_and_evaluate`) and its config's parts;
* :mod:`bottleneck.runs.language_model`: the language model experiment's config, presets,
  builder, run and :func:`~bottleneck.runs.language_model.load_run`.

:mod:`bottleneck.train` trains (pure steps; it imports nothing of this package); the scripts in
``experiments/`` are presets and ``main`` over both.
"""

from bottleneck.runs.cli import Checked, markdown_table, parse_config, progress, pyplot
from bottleneck.runs.folder import (
    RunDir,
    RunFolderError,
    TrainingInterrupted,
    UsageError,
    code_commit,
    open_run,
    results_page,
)

__all__ = [
    "Checked",
    "RunDir",
    "RunFolderError",
    "TrainingInterrupted",
    "UsageError",
    "code_commit",
    "markdown_table",
    "open_run",
    "parse_config",
    "progress",
    "pyplot",
    "results_page",
]
