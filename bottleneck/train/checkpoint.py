"""Checkpoints with Orbax, and stopping cleanly on SIGINT / SIGTERM.

:class:`CheckpointStore` keeps numbered checkpoints in one folder; each holds named pytrees of
arrays and one JSON document (counters, histories, anything small). Pytrees are stored as their
flat list of leaves and rebuilt from a template of the same structure on restore, so any pytree
(NNX ``State``, optax states, tuples of named tuples) round-trips, and a structure mismatch is
reported with a clear message instead of a deep Orbax error.

:class:`StopSignals` turns the first SIGINT/SIGTERM into a flag that a training loop polls
between steps, so that it can save and exit with status ``128 + signal`` (the shell convention);
a second signal interrupts at once.

:class:`RunLock` gives one process at a time a run folder, so that two runs started with the
same output folder cannot write into, or resume from, each other's checkpoints.
"""

from __future__ import annotations

import os
import signal
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from bottleneck.train.experiment import RunFolderError

META_ITEM = "meta"


def _leaves_dict(tree: Any) -> dict[str, np.ndarray]:
    """``{"00000": leaf_0, ...}``: the pytree's leaves as host arrays, in flattening order."""
    return {f"{i:05d}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(tree))}


def _rebuild(name: str, leaves: Mapping[str, Any], template: Any) -> Any:
    """The pytree of ``template``'s structure holding the saved ``leaves``; checks shapes/dtypes."""
    template_leaves, treedef = jax.tree.flatten(template)
    if len(leaves) != len(template_leaves):
        raise ValueError(
            f"checkpoint item {name!r} holds {len(leaves)} arrays but the model expects "
            f"{len(template_leaves)}: it was written by a different model or optimizer"
        )
    restored = []
    for i, expected in enumerate(template_leaves):
        value = np.asarray(leaves[f"{i:05d}"])
        if value.shape != np.shape(expected) or value.dtype != np.asarray(expected).dtype:
            raise ValueError(
                f"checkpoint item {name!r}, array {i}: saved {value.dtype}{list(value.shape)}, "
                f"expected {np.asarray(expected).dtype}{list(np.shape(expected))}"
            )
        # Back where the template lives (a mesh's shardings included).
        sharding = getattr(expected, "sharding", None)
        restored.append(
            jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)
        )
    return jax.tree.unflatten(treedef, restored)


class CheckpointStore:
    """Numbered checkpoints in ``directory`` (an Orbax ``CheckpointManager``).

    Saves are synchronous, so a checkpoint is complete on disk when :meth:`save` returns; Orbax
    writes into a temporary folder and renames it, so a killed save never leaves a checkpoint
    that :meth:`latest_step` would return.

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
        """Writes checkpoint ``step``: each pytree in ``items`` and the JSON-able ``meta``."""
        if META_ITEM in items:
            raise ValueError(f"items must not use the reserved name {META_ITEM!r}")
        args = {name: ocp.args.StandardSave(_leaves_dict(tree)) for name, tree in items.items()}
        args[META_ITEM] = ocp.args.JsonSave(dict(meta))
        self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        self._manager.wait_until_finished()

    def restore(
        self, templates: Mapping[str, Any], step: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Reads the pytrees named in ``templates`` (rebuilt in their structure) and the meta.

        Args:
          templates: item name -> a pytree of the expected structure, shapes and dtypes (for
            example the freshly initialised state); items not named are not read.
          step: which checkpoint; default the latest.

        Returns:
          ``(items, meta)``.

        Raises:
          FileNotFoundError: there is no checkpoint (at ``step``).
          ValueError: an item does not match its template.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint {'' if step is None else step} in {self.directory}"
            )
        args = {name: ocp.args.StandardRestore() for name in templates}
        args[META_ITEM] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        items = {
            name: _rebuild(name, restored[name], template) for name, template in templates.items()
        }
        return items, dict(restored[META_ITEM])

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class StopSignals:
    """Context manager: the first SIGINT/SIGTERM sets :attr:`signum` instead of killing.

    Inside the ``with`` block, poll :attr:`requested` between steps; on a request, save and
    ``sys.exit(stop.exit_code)``. A second signal restores the previous handler and re-raises
    the signal (SIGINT: ``KeyboardInterrupt``), so a stuck run can still be stopped. Handlers
    can only be installed from the main thread; elsewhere this is a no-op.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + (self.signum or 0)

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.signum is not None:  # second signal: stop now
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name} received: finishing the current step, saving a "
            "checkpoint, then exiting (send it again to stop at once)",
            flush=True,
        )

    def __enter__(self) -> StopSignals:
        try:
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread
            self._previous.clear()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class RunFolderBusy(RunFolderError):
    """Another live process holds the run folder (see :class:`RunLock`)."""


class RunLock:
    """Context manager: exclusive use of ``directory`` by this process (``directory/.lock``).

    The lock file holds the owner's pid. A lock whose process is gone (killed with SIGKILL,
    a crashed machine) is stale and taken over; one held by a live process raises
    :class:`RunFolderBusy`. For processes on one machine (pids are local).
    """

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / ".lock"
        self.held = False

    def acquire(self) -> None:
        """Takes the folder (a no-op when already held); :class:`RunFolderBusy` if in use."""
        if self.held:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                owner = _lock_owner(self.path)
                if owner is not None and _is_alive(owner):
                    raise RunFolderBusy(
                        f"{self.path.parent} is in use by process {owner}; wait for it, stop "
                        f"it, or choose another folder (if {owner} is not a run, delete "
                        f"{self.path})"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self.held = True
            return

    def release(self) -> None:
        if self.held and _lock_owner(self.path) == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _lock_owner(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
