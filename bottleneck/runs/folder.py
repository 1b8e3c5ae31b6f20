"""An experiment's output folder: its record of the run (``config.json``), metrics and results.

:func:`open_run` checks that the folder may be used (:func:`check_run_folder`: not another
experiment's, not a file), records the config and returns a :class:`RunDir` that writes JSON,
CSV, metric lines and Markdown results pages into it; :func:`check_resumable` compares a config
with the one recorded. A page (:func:`results_page`) opens with the command, the code's commit
(:func:`code_commit`) and the machine (:func:`machine_description`) that made it.
A config is recorded as JSON by :func:`to_jsonable` and read back by :func:`config_from_jsonable`.

:class:`RunLock` gives one process at a time a run folder, so that two runs started with the
same output folder cannot write into, or resume from, each other's checkpoints.
:class:`StopSignals` turns the first SIGINT/SIGTERM into a flag that a training loop polls
between steps, so that it can save and exit with status ``128 + signal`` (the shell convention);
a second signal interrupts at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import logging
import os
import platform
import shlex
import signal
import subprocess
import sys
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np

from bottleneck.runs import rows

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")


class UsageError(ValueError):
    """The command line, or a file or folder it names, cannot be used (scripts exit with 2)."""


class RunFolderError(UsageError):
    """An output folder that cannot be used: a file, unwritable, another experiment's run, a
    checkpointed run with another config, or (:class:`~bottleneck.runs.folder.RunFolderBusy`)
    a folder in use."""


class TrainingInterrupted(Exception):
    """A run stopped by SIGINT / SIGTERM once it had saved what a rerun needs to resume.

    Attributes:
      exit_code: the status the scripts exit with, ``128 + signal`` (130 for SIGINT, 143 for
        SIGTERM: the shell's convention; :attr:`~bottleneck.runs.folder.StopSignals.exit_code`).
    """

    def __init__(self, exit_code: int):
        super().__init__(f"interrupted (exit status {exit_code}): rerun the same command to resume")
        self.exit_code = exit_code


def to_jsonable(obj: Any) -> Any:
    """``obj`` with dataclasses, tuples, paths, NumPy/JAX arrays and scalars made JSON-friendly.

    A dataclass becomes a dict of its fields, except a part chosen from a union (an instance of a
    class with a ``family`` attribute, such as the language model's ``model``): the field holds
    the family's name and the part's fields go under that name, ``{"model": "transformer",
    "transformer": {...}}``, so the record says which was chosen.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        tree: dict[str, Any] = {}
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            family = getattr(type(value), "family", None)
            if family is None:
                tree[field.name] = to_jsonable(value)
            else:
                tree[field.name], tree[family] = family, to_jsonable(value)
        return tree
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (np.ndarray, np.generic, jax.Array)):
        return to_jsonable(np.asarray(obj).tolist())
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    raise TypeError(f"cannot write {type(obj).__name__} as JSON: {obj!r}")


def config_from_jsonable(
    config_cls: type[ConfigT], tree: Mapping[str, Any], _prefix: str = ""
) -> ConfigT:
    """The config that :func:`to_jsonable` turned into ``tree`` (``config.json``'s ``"config"``).

    Fields that ``tree`` lacks keep their defaults (a run recorded before they existed); a key
    that names no field is a ``ValueError`` naming it (a run of another version), but for the
    groups of a union's other families (runs recorded when every family had its group). JSON's
    lists become tuples again for tuple fields. The config checks itself as it is built.

    Example:
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config:
      ...     lr: float = 1.0
      ...     widths: tuple[int, ...] = (8,)
      >>> config_from_jsonable(Config, {"widths": [4, 8]})
      Config(lr=1.0, widths=(4, 8))
    """
    hints = typing.get_type_hints(config_cls)
    values, known = {}, set()
    for field in dataclasses.fields(config_cls):
        tp, value = hints[field.name], tree.get(field.name, dataclasses.MISSING)
        families = {m.family: m for m in typing.get_args(tp) if hasattr(m, "family")}
        known |= {field.name, *families}
        key = field.name
        if isinstance(value, str) and value in families:  # a union's part: its name, its group
            tp, key = families[value], value
            value = tree.get(key, {})
        if value is dataclasses.MISSING:
            continue
        if dataclasses.is_dataclass(tp):
            value = config_from_jsonable(tp, value, f"{_prefix}{key}.")
        elif typing.get_origin(tp) is tuple and isinstance(value, list):
            value = tuple(value)
        values[field.name] = value
    unknown = [_prefix + name for name in tree if name not in known]
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    return config_cls(**values)


@dataclasses.dataclass(frozen=True)
class RunDir:
    """One experiment's output folder; create it with :func:`open_run`.

    Attributes:
      root: the folder.
    """

    root: Path

    def path(self, name: str) -> Path:
        """``root / name``, creating the parent folders (``name`` may hold subfolders)."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Append ``metrics`` as one JSON line to ``metrics.jsonl`` (flushed before returning)."""
        with self.path("metrics.jsonl").open("a") as f:
            f.write(json.dumps(to_jsonable(metrics)) + "\n")

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` (see :func:`to_jsonable`) as indented JSON to ``root / name``."""
        return rows.write_json(self.path(name), to_jsonable(obj))

    def write_page(self, name: str, title: str, body: str) -> Path:
        """Write a Markdown results page (:func:`results_page`) to ``root / name``.

        Its header names the command and commit that ``config.json`` recorded when the run
        started (:func:`open_run`), not the checkout's state when the page is written.
        """
        record_path = self.root / "config.json"
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
        path = self.path(name)
        path.write_text(
            results_page(title, body, command=record.get("argv"), commit=record.get("commit"))
        )
        return path

    def write_csv(self, name: str, table: Sequence[Mapping[str, Any]]) -> Path:
        """Write ``table``'s rows as CSV; the columns are the union of the rows' keys, in
        first-seen order."""
        return rows.write_csv(self.path(name), [to_jsonable(dict(row)) for row in table])


def code_commit() -> str:
    """The commit of the checkout this library runs from, ``-dirty`` if its code differs from it.

    Only ``bottleneck/``, ``experiments/`` and ``benchmarks/`` count (a results file written
    into the checkout does not make it dirty); ``"unknown"`` when the library is not the top of
    a git checkout (an installed copy, even one inside another project's repository).
    """
    root = Path(__file__).resolve().parents[2]
    try:
        toplevel, sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        if Path(toplevel).resolve() != root:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--",
             "bottleneck", "experiments", "benchmarks"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, ValueError, subprocess.CalledProcessError):
        return "unknown"
    return sha[:12] + ("-dirty" if dirty else "")


# Settings read when the process starts that move its speed but not its numbers: a page
# measured under one of them says so (glibc's huge pages take XLA:CPU's per-call temporaries
# from ~45,000 page faults a Transformer step to ~700; docs/benchmarks.md).
SPEED_ENVIRONMENT = ("XLA_FLAGS", "GLIBC_TUNABLES", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def machine_description() -> str:
    """The machine in a few words: CPU model, cores, OS, JAX version and backend (with the
    accelerator's name, e.g. ``gpu (NVIDIA H200)``, where it is not the CPU), and the
    :data:`SPEED_ENVIRONMENT` variables that are set."""
    backend = jax.default_backend()
    settings = [f"{name}={os.environ[name]}" for name in SPEED_ENVIRONMENT if os.environ.get(name)]
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}; JAX {jax.__version__} on "
        f"{backend if backend == 'cpu' else accelerator()}"
        + (f"; {', '.join(settings)}" if settings else "")
    )


def cpu_model(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> str:
    """The CPU's model as ``cpuinfo`` names it, with its family and model numbers, since the
    name alone may not tell generations apart (``"AMD EPYC, family 26 model 2"``: a virtual
    machine may report only the brand); ``platform.processor()`` where there is no such file."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block describes them all
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    return name


def accelerator() -> str:
    """The device JAX computes on, by backend and model: ``"cpu (AMD EPYC, family 26 model
    2)"``, ``"gpu (NVIDIA H200)"``. Two runs whose float arithmetic may differ (another CPU
    generation, another GPU) get different names."""
    backend = jax.default_backend()
    name = cpu_model() if backend == "cpu" else jax.devices()[0].device_kind
    return f"{backend} ({name})"


def results_page(
    title: str, body: str, *, command: Sequence[str] | None = None, commit: str | None = None
) -> str:
    """A Markdown results page: ``title``, then who wrote it, then ``body``.

    The header names the command (default: this process's, as ``python ARGV``), the code's
    commit (default: :func:`code_commit` now), the machine (:func:`machine_description`) and
    the UTC date, so that a number on the page can be traced to the code and hardware that
    produced it.

    Example:
      >>> page = results_page("Ranks", "| d | rank |", command=["experiments/rank.py"])
      >>> page.splitlines()[0], page.splitlines()[2].startswith("Written by `python experiments/rank.py`")
      ('# Ranks', True)
    """
    argv = sys.argv if command is None else command
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    header = (
        f"Written by `python {shlex.join(argv)}` at commit `{commit or code_commit()}` on "
        f"{machine_description()}, {date}."
    )
    return f"# {title}\n\n{header}\n\n{body.strip()}\n"


def experiment_name(config: Any) -> str:
    """The experiment a config belongs to: the stem of the file that defines its class.

    The same whether the script runs as ``__main__`` or is imported (``lm_study`` runs
    ``language_model`` in-process), so a run folder's owner is stable.
    """
    return Path(inspect.getfile(type(config))).stem


def check_run_folder(out_dir: str | Path, config: Any) -> Path:
    """``out_dir`` as a path, or :class:`RunFolderError` if this experiment may not use it.

    A run folder records its experiment in ``config.json``; another experiment's folder (or one
    whose ``config.json`` names none) is refused rather than overwritten, and so is a path that
    is a file.
    """
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise RunFolderError(f"output folder {root} exists and is not a folder")
    existing = next((p for p in root.absolute().parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise RunFolderError(f"output folder {root} cannot be created: {existing} is not a folder")
    saved = root / "config.json"
    if saved.is_file():
        try:
            owner = json.loads(saved.read_text()).get("experiment")
        except (json.JSONDecodeError, AttributeError):
            owner = None
        if owner != experiment_name(config):
            raise RunFolderError(
                f"output folder {root} holds a run of {owner or 'an unknown experiment'!s}, not "
                f"of {experiment_name(config)}; choose another --out_dir"
            )
    return root


def check_resumable(root: str | Path, config: Any, may_change: Collection[str] = ()) -> None:
    """:class:`RunFolderError` if ``root`` holds a run made with another ``config``.

    Compares ``config`` with the one recorded in ``root/config.json`` (if any) field by field,
    parts by their dotted names in the record (:func:`to_jsonable`); a field named in
    ``may_change``, or inside a part named there, may differ (say, the epoch budget or the final
    evaluation's options). What the record holds beyond ``config`` (a union's other family) is
    not compared.
    """
    path = Path(root) / "config.json"
    if not path.is_file():
        return
    changed = config_changes(json.loads(path.read_text()).get("config", {}), config, may_change)
    if changed:
        raise RunFolderError(
            f"{root} holds a run made with a different config ({'; '.join(changed)}); "
            "rerun with the same flags to resume it, or choose another --out_dir"
        )


def config_changes(
    recorded: Mapping[str, Any], config: Any, may_change: Collection[str] = ()
) -> list[str]:
    """The fields in which ``config`` differs from ``recorded`` (a config as :func:`to_jsonable`
    wrote it), ``"name: old -> new"`` each by its dotted name, but for the fields named in
    ``may_change`` or inside a part named there: empty when both are the same run's. The one
    test of "is this the same run" (:func:`check_resumable`, a script's cached results)."""
    saved = _dotted(recorded)
    return [
        f"{name}: {saved.get(name)!r} -> {value!r}"
        for name, value in _dotted(to_jsonable(config)).items()
        if not _free(name, may_change) and saved.get(name) != value
    ]


def _free(name: str, may_change: Collection[str]) -> bool:
    return any(name == free or name.startswith(f"{free}.") for free in may_change)


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as one level keyed by dotted paths (``{"optimizer.lr": 20.0}``)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat |= _dotted(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


def open_run(out_dir: str | Path, config: Any, *, resume: bool = False) -> RunDir:
    """Create ``out_dir`` and record the run in ``config.json``.

    ``config.json`` holds the experiment's name (:func:`experiment_name`), ``config``
    (:func:`to_jsonable`), its ``seed`` field (if any) at the top level, the JAX version and
    backend, a UTC timestamp, the command line (``command``, and ``argv`` as a list) and the
    code's commit (:func:`code_commit`), so that a result can be traced back to how it was made. A folder of another experiment is refused (:func:`check_run_folder`).

    Args:
      out_dir: the output folder (created with its parents).
      config: a dataclass instance.
      resume: keep an existing ``metrics.jsonl`` and append to it; by default a new run starts
        with an empty one, so metrics of an earlier run in the same folder are not mixed in.

    Returns:
      The :class:`RunDir`.

    Raises:
      RunFolderError: ``out_dir`` is a file, cannot be created, or belongs to another experiment.
    """
    root = check_run_folder(out_dir, config)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(f"cannot create output folder {root}: {err.strerror}") from None
    run = RunDir(root)
    if not resume:
        run.path("metrics.jsonl").unlink(missing_ok=True)
    run.write_json(
        "config.json",
        {
            "experiment": experiment_name(config),
            "config": config,
            "seed": getattr(config, "seed", None),
            "jax_version": jax.__version__,
            "backend": jax.default_backend(),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "argv": sys.argv,
            "commit": code_commit(),
        },
    )
    return run


# -- one process at a time, stopping cleanly ----------------------------------------------------


class StopSignals:
    """Context manager: the first SIGINT/SIGTERM sets :attr:`signum` instead of killing.

    Inside the ``with`` block, poll :attr:`requested` between steps; on a request, save and
    raise :class:`~bottleneck.runs.folder.TrainingInterrupted` ``(stop.exit_code)``. A second signal restores the previous handler and re-raises
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
        logger.warning(
            "%s received: finishing the current step, saving a checkpoint, then exiting (send it "
            "again to stop at once)",
            signal.Signals(signum).name,
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
