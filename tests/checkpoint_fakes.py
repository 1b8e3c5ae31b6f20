"""Stand-ins for tests of bottleneck/train/checkpoint.py: an older commit's checkpoint writer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def save_old_format(
    directory: Path, step: int, items: Mapping[str, Any], meta: Mapping[str, Any]
) -> None:
    """Writes checkpoint ``step`` as ``CheckpointStore.save`` did up to commit c9a2166: each
    pytree as its leaves in flattening order, gathered to the host, named 00000, 00001, ..."""
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(directory, options=options) as manager:
        args = {
            name: ocp.args.StandardSave(
                {f"{i:05d}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(tree))}
            )
            for name, tree in items.items()
        }
        manager.save(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(dict(meta))))
