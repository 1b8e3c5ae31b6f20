"""Training and experiment plumbing shared by every experiment script."""

from bottleneck.train.experiment import (
    RunDir,
    RunFolderError,
    check_run_folder,
    open_run,
    parse_config,
    print_table,
    progress,
    to_jsonable,
)
from bottleneck.train.steps import Trainer, make_optimizer

__all__ = [
    "RunDir",
    "RunFolderError",
    "Trainer",
    "check_run_folder",
    "make_optimizer",
    "open_run",
    "parse_config",
    "print_table",
    "progress",
    "to_jsonable",
]
