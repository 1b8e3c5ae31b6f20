"""Checkpoints with Orbax.

:class:`CheckpointStore` keeps numbered checkpoints in one folder; each holds named pytrees of
arrays and one JSON document (counters, histories, anything small). A pytree is stored by its
leaves' key paths, the names a user reads (``params/model/head/bias/value``,
``opt_state/1/0/mu/model/head/bias/value``; an NNX parameter ends in ``value`` as in Flax's own
Orbax checkpoints): Orbax writes the arrays themselves, each shard by the process that holds
it, and reads them back onto the shardings of a template of the same structure (for example the
freshly initialised state), so any pytree (NNX ``State``, optax states, tuples of named tuples)
round-trips onto a mesh. A checkpoint that does not fit its template is refused with a
``ValueError`` that names the paths that differ; :func:`checkpoint_contents` lists what a
checkpoint holds without reading its arrays. A save that fails (a full disk) raises
:class:`CheckpointWriteError`, deletes its partial folder and leaves the previous checkpoint as
the latest.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from bottleneck.runs.folder import RunFolderError

META_ITEM = "meta"

# (dtype name, shape) of one stored or expected array.
Signature = tuple[str, tuple[int, ...]]


class CheckpointWriteError(RunFolderError):
    """A checkpoint could not be written (a full disk, a read-only folder); its partial folder
    is deleted and the folder's previous checkpoint is still the latest."""


# -- pytrees by name -----------------------------------------------------------------------------


# The name of a pytree that is one array (a model's carry can be): its key path is empty, and
# Orbax stores no lone array as a pytree.
LONE_ARRAY = "array"


def _path_name(path: tuple[Any, ...]) -> str:
    """A leaf's key path as a ``/``-separated name: ``params/model/head/bias/value``."""
    return jax.tree_util.keystr(path, simple=True, separator="/") or LONE_ARRAY


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for each leaf of ``tree``, in flattening order."""
    return [
        (_path_name(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _nested(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``[("a/b", x), ("a/c", y)]`` -> ``{"a": {"b": x, "c": y}}``: the tree Orbax stores, so
    that its metadata and files nest like the model's modules.

    A name that is empty, repeated, or both a leaf and a parent (dictionary keys ``0`` and
    ``"0"`` side by side, a key holding ``/``) would lose an array, so it is a ``ValueError``.
    """
    nested: dict[str, Any] = {}
    for name, leaf in named:
        *parents, last = name.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        if not last or not isinstance(node, dict) or last in node:
            raise ValueError(f"cannot store a pytree by name: its key path {name!r} is ambiguous")
        node[last] = leaf
    return nested


def _signature(array: Any) -> Signature:
    return np.dtype(array.dtype).name, tuple(int(n) for n in array.shape)


def _describe(signature: Signature) -> str:
    """``float32[2, 4]``."""
    dtype, shape = signature
    return f"{dtype}{list(shape)}"


# How checkpoints written before commit c9a2166 named a pytree's leaves: 00000, 00001, ... in
# flattening order.
_UNNAMED_LEAF = re.compile(r"\d{5}")


def _few(entries: list[str], shown: int = 3) -> str:
    more = f", and {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(entries[:shown]) + more


def _misfits(saved: Mapping[str, Signature], expected: Mapping[str, Signature]) -> list[str]:
    """What keeps arrays ``saved`` under their names from filling ``expected``'s (empty: they
    fit): the names missing, unexpected and of another dtype or shape, a few each."""
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    changed = [
        f"{name} (saved {_describe(saved[name])} vs expected {_describe(signature)})"
        for name, signature in expected.items()
        if name in saved and saved[name] != signature
    ]
    groups = (
        ("missing in the checkpoint", missing),
        ("unexpected in the checkpoint", unexpected),
        ("of another dtype or shape", changed),
    )
    return [f"{len(entries)} {label}: {_few(entries)}" for label, entries in groups if entries]


def _restore_target(template: Any) -> dict[str, Any]:
    """The nested tree of ``jax.ShapeDtypeStruct`` that Orbax fills: each template leaf's shape,
    dtype and sharding (the arrays come back where the template's live, a mesh's included)."""
    return _nested(
        (name, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding))
        for name, leaf in _named_leaves(template)
    )


def _rebuilt(template: Any, restored: Any) -> Any:
    """The pytree of ``template``'s structure (NNX ``State``, named tuples and all) holding the
    arrays of the ``restored`` nested tree under the template's leaves' names."""
    by_name = dict(_named_leaves(restored))
    names = [name for name, _ in _named_leaves(template)]
    return jax.tree.unflatten(jax.tree.structure(template), [by_name[name] for name in names])


# -- write failures ------------------------------------------------------------------------------

# TensorStore (Orbax's array writer) reports an operating-system error as a ValueError whose
# message carries the errno: 'RESOURCE_EXHAUSTED: ... No space left on device [os_error_code=28]'.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _is_write_failure(err: Exception) -> bool:
    """An error of the filesystem (full, read-only, gone), not of the code or the data."""
    return isinstance(err, OSError) or bool(_OS_ERROR_CODE.search(str(err)))


def _failure_reason(err: Exception) -> str:
    """``No space left on device``: the operating system's words for a write failure."""
    code = _OS_ERROR_CODE.search(str(err))
    if code:
        return os.strerror(int(code.group(1)))
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err).splitlines()[0]


def _failed_item(err: Exception, step: int, names: Collection[str]) -> str | None:
    """The item whose folder the failed write was in (Orbax writes item ``state`` of step 8 to
    ``8.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/``), or None."""
    found = re.search(rf"(?:^|/){step}\.orbax-checkpoint-tmp[^/]*/([^/.]+)", str(err))
    return found.group(1) if found and found.group(1) in names else None


class _FailedWriteEchoes:
    """Context manager around a save: silences the echoes of a failed write, and waits until
    the writes it abandoned have ended.

    When one array write fails, Orbax logs the error with its traceback in each thread it passes
    through, then returns leaving the other writes running on TensorStore's threads: as each
    ends, its callback finds Orbax's event loop closed (``RuntimeError: Event loop is closed``,
    through ``sys.unraisablehook``), and asyncio logs each abandoned gather's error when it is
    garbage collected, at exit if not before. A full disk printed 800 lines around the one
    error, which still reaches the caller (as :class:`CheckpointWriteError`).
    """

    LOGGERS = ("absl", "asyncio")
    ABANDONED_WRITE_ENDED = "Event loop is closed"

    def __enter__(self) -> _FailedWriteEchoes:
        self._last_echo = time.monotonic()
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self._is_not_write_failure)
        return self

    @staticmethod
    def _is_not_write_failure(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, Exception) and _is_write_failure(error))

    def _unraisable(self, unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == self.ABANDONED_WRITE_ENDED:
            self._last_echo = time.monotonic()
        else:
            self._previous_hook(unraisable)

    def settle(self, quiet: float = 0.5, limit: float = 30.0) -> None:
        """Returns once no abandoned write has ended for ``quiet`` seconds (or after ``limit``),
        its echoes collected: a write still running could put files back into the partial
        folder, and a gather collected later would log outside this silencer."""
        start = self._last_echo = time.monotonic()
        while time.monotonic() - self._last_echo < quiet and time.monotonic() - start < limit:
            time.sleep(0.05)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
            gc.collect()

    def __exit__(self, *exc_info: object) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self._is_not_write_failure)
        sys.unraisablehook = self._previous_hook


class CheckpointStore:
    """Numbered checkpoints in ``directory`` (an Orbax ``CheckpointManager``).

    Saves are synchronous, so a checkpoint is complete on disk when :meth:`save` returns; Orbax
    writes into a temporary folder and renames it, so a killed save never leaves a checkpoint
    that :meth:`latest_step` would return. Checkpoints written before pytrees were stored by
    name (up to commit c9a2166: arrays named ``00000``, ``00001``, ...) are refused with a
    ``ValueError`` that says so.

    Args:
      directory: the checkpoint folder (created).
      max_to_keep: how many of the newest checkpoints to keep.
    """

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
        """Writes checkpoint ``step``: each pytree in ``items`` (by its key paths) and the
        JSON-able ``meta``.

        Raises:
          CheckpointWriteError: the filesystem refused a write (a full disk); the partial
            checkpoint is deleted and the previous one stays the latest.
        """
        if META_ITEM in items:
            raise ValueError(f"items must not use the reserved name {META_ITEM!r}")
        args = {
            name: ocp.args.StandardSave(_nested(_named_leaves(tree)))
            for name, tree in items.items()
        }
        args[META_ITEM] = ocp.args.JsonSave(dict(meta))
        with _FailedWriteEchoes() as echoes:
            try:
                self._manager.save(step, args=ocp.args.Composite(**args), force=True)
                self._manager.wait_until_finished()
                return
            except (OSError, ValueError) as err:
                if not _is_write_failure(err):
                    raise
                item, reason = _failed_item(err, step, args), _failure_reason(err)
            # Out of the handler, so that the error and the writes it abandoned can be collected.
            echoes.settle()
        self._delete_partial(step)
        raise CheckpointWriteError(self._write_failure_message(step, item, reason))

    def _delete_partial(self, step: int) -> None:
        """Deletes the folder Orbax was writing step ``step`` into (``8.orbax-checkpoint-tmp``)."""
        for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)

    def _write_failure_message(self, step: int, item: str | None, reason: str) -> str:
        latest = self.latest_step()
        kept = "there is no earlier one" if latest is None else f"checkpoint {latest} is kept"
        return (
            f"cannot write checkpoint {step}{'' if item is None else f' (item {item!r})'} in "
            f"{self.directory}: {reason}; the partial checkpoint was deleted and {kept}"
        )

    def contents(self, step: int | None = None) -> dict[str, dict[str, Signature]]:
        """Item name -> array name -> ``(dtype, shape)`` of checkpoint ``step`` (default the
        latest), from its metadata (no array is read); see :func:`checkpoint_contents`."""
        step = self._existing_step(step)
        return {name: self._saved(step, name) for name in self._item_names(step)}

    def _existing_step(self, step: int | None) -> int:
        """``step``, or the latest when None; FileNotFoundError if there is no such checkpoint."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint {'' if step is None else step} in {self.directory}"
            )
        return step

    def _item_names(self, step: int) -> list[str]:
        """The pytrees checkpoint ``step`` holds: Orbax gives each item a folder of its name."""
        folders = (self.directory / str(step)).iterdir()
        return sorted(f.name for f in folders if f.is_dir() and f.name != META_ITEM)

    def _saved(self, step: int, name: str) -> dict[str, Signature]:
        """Array name -> ``(dtype, shape)`` of item ``name`` in checkpoint ``step``."""
        metadata = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / name)
        return {path: _signature(array) for path, array in _named_leaves(metadata.tree)}

    def restore(
        self, templates: Mapping[str, Any], step: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Reads the pytrees named in ``templates`` (rebuilt in their structure, on their leaves'
        shardings) and the meta.

        Args:
          templates: item name -> a pytree of jax arrays of the expected structure, shapes,
            dtypes and shardings (for example the freshly initialised state); items not named
            are not read.
          step: which checkpoint; default the latest.

        Returns:
          ``(items, meta)``.

        Raises:
          FileNotFoundError: there is no checkpoint (at ``step``).
          ValueError: an item does not fit its template; the message names the arrays that
            are missing, unexpected or of another dtype or shape.
        """
        step = self._existing_step(step)
        absent = [name for name in templates if name not in self._item_names(step)]
        if absent:
            raise ValueError(
                f"checkpoint {step} in {self.directory} holds no item {', '.join(absent)} (it "
                f"holds {', '.join(self._item_names(step))})"
            )
        for name, template in templates.items():
            saved = self._saved(step, name)
            if saved and all(_UNNAMED_LEAF.fullmatch(path) for path in saved):
                raise ValueError(
                    f"checkpoint {step} in {self.directory} holds arrays without names (00000, "
                    "00001, ...) as those written before commit c9a2166 do, which this version "
                    "does not read; retrain, or finish the run with that commit"
                )
            expected = {path: _signature(leaf) for path, leaf in _named_leaves(template)}
            misfits = _misfits(saved, expected)
            if misfits:
                raise ValueError(
                    f"checkpoint {step} in {self.directory}: item {name!r} does not fit, it was "
                    f"written by a different model or optimizer: {'; '.join(misfits)}"
                )
        args = {
            name: ocp.args.StandardRestore(_restore_target(template))
            for name, template in templates.items()
        }
        args[META_ITEM] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        items = {name: _rebuilt(template, restored[name]) for name, template in templates.items()}
        return items, dict(restored[META_ITEM])

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def checkpoint_contents(
    directory: str | os.PathLike, step: int | None = None
) -> dict[str, dict[str, Signature]]:
    """What a checkpoint holds, by parameter path, read from its metadata (no array is loaded).

    Args:
      directory: a checkpoint folder (a run's ``checkpoints/``).
      step: which checkpoint; default the latest.

    Returns:
      item name -> array name (its key path) -> ``(dtype, shape)``.

    Raises:
      FileNotFoundError: ``directory`` is not a folder or holds no checkpoint (at ``step``).

    Example:
      >>> contents = checkpoint_contents("runs/lm/checkpoints")  # doctest: +SKIP
      >>> contents["best_params"]["model/head/decoder/kernel/value"]  # doctest: +SKIP
      ('float32', (8, 12))
    """
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"no checkpoint folder {directory}")
    with CheckpointStore(directory) as store:
        return store.contents(step)
