"""A run on disk: its command line, folder, checkpoints, and the language model experiment.

* :mod:`bottleneck.runs.cli`: the checked config base (:class:`Checked`), the scripts' command
  line (:func:`parse_config`), one-line errors, tables and progress bars;
* :mod:`bottleneck.runs.folder`: run folders (:func:`open_run`, :class:`RunDir`: config.json,
  the resume check, results pages, the code's commit and the device);
* :mod:`bottleneck.runs.checkpoint`: Orbax checkpoints of a run, the stop signals, the lock;
* :mod:`bottleneck.runs.language_model`: the language model experiment's config, presets,
  builder, run and :func:`~bottleneck.runs.language_model.load_run`.

:mod:`bottleneck.train` trains (its loop writes through these); the scripts in ``experiments/``
are presets and ``main`` over both.
"""

from bottleneck.runs.cli import Checked, markdown_table, parse_config, progress
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
    "results_page",
]
