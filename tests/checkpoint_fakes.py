"""Stand-ins for tests of bottleneck/runs/checkpoint.py: an older commit's checkpoint writer,
and a full disk (TensorStore's own error, as a real full tmpfs raised it; no test mounts one)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore


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


def fill_disk(monkeypatch: Any, spare_checkpoints: int = 0) -> None:
    """From the checkpoint after the next ``spare_checkpoints`` on, every array Orbax creates
    fails as on a full disk: TensorStore's error, as a real full tmpfs raised it."""
    real_open = tensorstore.open
    steps_written: list[str] = []

    def open_on_a_full_disk(spec: Any, *args: Any, **kwargs: Any) -> Any:
        kvstore = spec.to_json()["kvstore"] if isinstance(spec, tensorstore.Spec) else {}
        folder = kvstore.get("base", kvstore).get("path", "")
        step = re.search(r"/(\d+)\.orbax-checkpoint-tmp", folder)
        if kwargs.get("create") and step:
            if step.group(1) not in steps_written:
                steps_written.append(step.group(1))
            if len(steps_written) > spare_checkpoints:
                raise ValueError(
                    f'RESOURCE_EXHAUSTED: Error writing "{kvstore.get("path", "")}0.0" in OCDBT '
                    f'database at local file "{folder}": Failed writing: "{folder}d/0": Failed to '
                    "write 4096 bytes to file 11: No space left on device [os_error_code='28']"
                )
        return real_open(spec, *args, **kwargs)

    monkeypatch.setattr(tensorstore, "open", open_on_a_full_disk)
