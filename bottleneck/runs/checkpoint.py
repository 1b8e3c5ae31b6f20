"""Checkpoints with plain Orbax: named pytrees saved as they are (``StandardSave``) and one JSON
document per step, restored onto a template's structure and shardings (so a state round-trips
onto a mesh). Added to Orbax: a checkpoint that does not fit its template is refused naming the
paths that differ; :func:`checkpoint_contents` lists arrays without reading them; a failed
write (a full disk) is one :class:`CheckpointWriteError`, the previous checkpoint kept.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from bottleneck.runs.folder import RunFolderError

META_ITEM = "meta"
# StandardSave takes no lone array (a model's carry can be one): it is stored as {"array": it}.
LONE_ARRAY = "array"

Signature = tuple[str, tuple[int, ...]]  # (dtype name, shape) of a stored or expected array


class CheckpointWriteError(RunFolderError):
    """A checkpoint could not be written (a full disk, a read-only folder); its partial folder
    is deleted and the folder's previous checkpoint is still the latest."""


def _as_tree(item: Any) -> Any:
    return {LONE_ARRAY: item} if isinstance(item, (jax.Array, np.ndarray)) else item


def _signatures(tree: Any) -> dict[str, Signature]:
    """Each leaf's key path (``params/kernel/value``) -> its ``(dtype, shape)``."""
    name = functools.partial(jax.tree_util.keystr, simple=True, separator="/")
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {name(path): (np.dtype(x.dtype).name, tuple(map(int, x.shape))) for path, x in leaves}


def _saved(folder: Path) -> dict[str, Signature]:
    """The signatures of the arrays of the item saved in ``folder``, from its metadata."""
    return _signatures(ocp.StandardCheckpointHandler().metadata(folder).tree)


def _misfits(saved: Mapping[str, Signature], expected: Mapping[str, Signature]) -> list[str]:
    """What keeps the arrays ``saved`` from filling ``expected`` (empty: they fit): the paths
    missing, unexpected and of another dtype or shape, three of each at most."""
    groups = {
        "missing in the checkpoint": [name for name in expected if name not in saved],
        "unexpected in the checkpoint": [name for name in saved if name not in expected],
        "of another dtype or shape": [
            f"{n} (saved {saved[n][0]}{list(saved[n][1])} vs expected {e[0]}{list(e[1])})"
            for n, e in expected.items()
            if n in saved and saved[n] != e
        ],
    }
    return [
        f"{len(names)} {label}: {', '.join(names[:3])}"
        + (f", and {len(names) - 3} more" if len(names) > 3 else "")
        for label, names in groups.items()
        if names
    ]


# TensorStore (Orbax's array writer) reports an operating-system error as a ValueError whose
# message carries the errno: 'RESOURCE_EXHAUSTED: ... No space left on device [os_error_code=28]'.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _write_failure(err: BaseException) -> str | None:
    """The operating system's words for an error of the filesystem (``No space left on
    device``), or None for an error of the code or the data."""
    code = _OS_ERROR_CODE.search(str(err))
    if code:
        return os.strerror(int(code.group(1)))
    if isinstance(err, OSError):
        return err.strerror or str(err).splitlines()[0]
    return None


class _FailedWriteEchoes:
    """Around a save: silences the echoes of a failed write (a full disk printed 800 lines: Orbax
    logs the error in each thread it passes, each abandoned write's callback finds Orbax's event
    loop closed, asyncio logs each abandoned gather); :meth:`settle` waits until they end."""

    LOGGERS = ("absl", "asyncio")

    def __enter__(self) -> _FailedWriteEchoes:
        self._last_echo, self._previous_hook = time.monotonic(), sys.unraisablehook
        sys.unraisablehook = self._unraisable
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self._is_not_write_failure)
        return self

    @staticmethod
    def _is_not_write_failure(record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] and _write_failure(record.exc_info[1]))

    def _unraisable(self, unraisable: Any) -> None:
        if str(unraisable.exc_value) == "Event loop is closed":  # an abandoned write ended
            self._last_echo = time.monotonic()
        else:
            self._previous_hook(unraisable)

    def settle(self, quiet: float = 0.5, limit: float = 30.0) -> None:
        """Returns once no abandoned write has ended for ``quiet`` seconds (or after ``limit``):
        a write still running could put files back into the partial folder."""
        start = self._last_echo = time.monotonic()
        while time.monotonic() - self._last_echo < quiet and time.monotonic() - start < limit:
            time.sleep(0.05)
        with warnings.catch_warnings():  # the abandoned gathers, collected while silenced
            warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
            gc.collect()

    def __exit__(self, *exc_info: object) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self._is_not_write_failure)
        sys.unraisablehook = self._previous_hook


class CheckpointStore(contextlib.AbstractContextManager):
    """Numbered checkpoints in ``directory`` (created), the newest ``max_to_keep`` kept. A save
    is complete on disk when :meth:`save` returns; a killed one leaves only Orbax's temporary
    folder, never a checkpoint that :meth:`latest_step` would return."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def save(self, step: int, items: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Writes checkpoint ``step``: each pytree in ``items`` and the JSON-able ``meta``;
        :class:`CheckpointWriteError` if the filesystem refuses a write (a full disk)."""
        if META_ITEM in items:
            raise ValueError(f"items must not use the reserved name {META_ITEM!r}")
        args = {name: ocp.args.StandardSave(_as_tree(tree)) for name, tree in items.items()}
        args[META_ITEM] = ocp.args.JsonSave(dict(meta))
        with _FailedWriteEchoes() as echoes:
            try:
                self._manager.save(step, args=ocp.args.Composite(**args), force=True)
                return self._manager.wait_until_finished()
            except (OSError, ValueError) as err:
                reason = _write_failure(err)
                if reason is None:
                    raise
                # Orbax writes item ``state`` of step 8 into ``8.orbax-checkpoint-tmp/state...``.
                folder = re.search(rf"{step}\.orbax-checkpoint-tmp[^/]*/([^/.]+)", str(err))
            echoes.settle()  # out of the handler, so that the error can be collected
        for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)
        item = f" (item {folder.group(1)!r})" if folder and folder.group(1) in items else ""
        latest = self.latest_step()
        kept = "there is no earlier one" if latest is None else f"checkpoint {latest} is kept"
        raise CheckpointWriteError(
            f"cannot write checkpoint {step}{item} in {self.directory}: {reason}; the partial "
            f"checkpoint was deleted and {kept}"
        )

    def _item_folders(self, step: int | None) -> tuple[int, dict[str, Path]]:
        """``step`` (default the latest) and its items' folders (Orbax gives each item one)."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint {'' if step is None else step} in {self.directory}"
            )
        folders = sorted(f for f in (self.directory / str(step)).iterdir() if f.is_dir())
        return step, {f.name: f for f in folders if f.name != META_ITEM}

    def contents(self, step: int | None = None) -> dict[str, dict[str, Signature]]:
        """What checkpoint ``step`` holds: see :func:`checkpoint_contents`."""
        return {name: _saved(folder) for name, folder in self._item_folders(step)[1].items()}

    def restore(
        self, templates: Mapping[str, Any], step: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(items, meta)`` of checkpoint ``step`` (default the latest): the items named in
        ``templates``, each in its template's structure on its leaves' shardings (a template is
        a pytree of arrays, such as the freshly initialised state). FileNotFoundError if there
        is no checkpoint; ValueError if an item is absent or does not fit its template, naming
        the arrays missing, unexpected or of another dtype or shape."""
        step, held = self._item_folders(step)  # only the items asked for are read
        absent = [name for name in templates if name not in held]
        if absent:
            raise ValueError(
                f"checkpoint {step} in {self.directory} holds no item {', '.join(absent)} (it "
                f"holds {', '.join(held)})"
            )
        trees = {name: _as_tree(template) for name, template in templates.items()}
        for name, tree in trees.items():
            misfits = _misfits(_saved(held[name]), _signatures(tree))
            if misfits:
                raise ValueError(
                    f"checkpoint {step} in {self.directory}: item {name!r} does not fit, it was "
                    f"written by a different model or optimizer: {'; '.join(misfits)}"
                )
        args = {
            name: ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
            for name, tree in trees.items()
        }
        args[META_ITEM] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        items = {
            name: restored[name] if tree is templates[name] else restored[name][LONE_ARRAY]
            for name, tree in trees.items()
        }
        return items, dict(restored[META_ITEM])

    def close(self) -> None:
        self._manager.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def checkpoint_contents(
    directory: str | os.PathLike, step: int | None = None
) -> dict[str, dict[str, Signature]]:
    """Item name -> array path (``/``-separated) -> ``(dtype, shape)`` of the checkpoint ``step``
    (default the latest) in ``directory`` (a run's ``checkpoints/``), from its metadata alone;
    FileNotFoundError if there is no such folder or checkpoint.

    Example:
      >>> checkpoint_contents("runs/lm/checkpoints")["best_params"]  # doctest: +SKIP
      {'model/head/decoder/kernel/value': ('float32', (8, 12)), ...}
    """
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"no checkpoint folder {directory}")
    with CheckpointStore(directory) as store:
        return store.contents(step)
