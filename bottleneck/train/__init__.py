"""Training and experiment plumbing shared by every experiment script."""

from bottleneck.train.experiment import (
    RunDir,
    open_run,
    parse_config,
    print_table,
    progress,
    to_jsonable,
)
from bottleneck.train.steps import Trainer, make_optimizer

__all__ = [
    "RunDir",
    "Trainer",
    "make_optimizer",
    "open_run",
    "parse_config",
    "print_table",
    "progress",
    "to_jsonable",
]
