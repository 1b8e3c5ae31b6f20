"""Training and experiment plumbing shared by every experiment script."""

from bottleneck.train.experiment import (
    RunDir,
    RunFolderError,
    UsageError,
    check_resumable,
    check_run_folder,
    config_from_jsonable,
    open_run,
    parse_config,
    print_table,
    progress,
    replace_fields,
    to_jsonable,
    validate_config,
)
from bottleneck.train.steps import Trainer, make_optimizer

__all__ = [
    "RunDir",
    "RunFolderError",
    "Trainer",
    "UsageError",
    "check_resumable",
    "check_run_folder",
    "config_from_jsonable",
    "make_optimizer",
    "open_run",
    "parse_config",
    "print_table",
    "progress",
    "replace_fields",
    "to_jsonable",
    "validate_config",
]
