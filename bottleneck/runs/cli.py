"""The thin layer every experiment script shares: checked configs, their command line, tables.

An experiment is a flat script with a config dataclass and a few named presets, config instances
(big_vision style). The config checks itself on construction (:class:`Checked`), so a config
built in a notebook, read back from a run folder or changed with ``dataclasses.replace`` is as
valid as one from the command line. :func:`parse_config` turns the dataclass into a command line
with `tyro <https://brentyi.github.io/tyro/>`_: a field holding another dataclass is a group of
flags (``--optimizer.lr``), a union of dataclasses is a choice made with a subcommand
(``model:transformer``); :func:`~bottleneck.runs.folder.open_run` records the config and
writes results into one output folder, :func:`markdown_table` formats the summary. The library
logs through :mod:`logging` (``bottleneck.*`` loggers); :func:`parse_config` shows those lines
on stderr (:func:`show_logs`).

Example script::

    @dataclasses.dataclass(frozen=True)
    class Config(Checked):
        width: Count = 128  # the layer's width
        experts: tuple[Count, ...] = (2, 4)
        seed: int = 0
        out_dir: str = "runs/example"

    config = parse_config(Config, {"smoke": Config(width=16)})
    with one_line_errors(config):
        run = open_run(config.out_dir, config)
        run.log_metrics({"step": 0, "loss": 1.0})
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import numbers
import os
import re
import shlex
import sys
import typing
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union

import numpy as np
import tyro
from tabulate import tabulate
from tqdm.auto import tqdm
from tyro.constructors import ConstructorRegistry, StructConstructorSpec

from bottleneck.runs.folder import TrainingInterrupted, UsageError, check_run_folder

ConfigT = TypeVar("ConfigT")
T = TypeVar("T")

DEFAULT_PRESET = "default"


# ----------------------------------------------------------------------------------------------
# Checked configs


@dataclasses.dataclass(frozen=True)
class Interval:
    """The values a number field may take, as ``Annotated[float, Interval("[0, 1)")]``.

    ``spec`` is an interval in the usual notation, a bracket for a closed end, a parenthesis for an
    open one and ``inf`` for no bound: ``"[1, inf)"``. On a tuple field it bounds every item.

    Example:
      >>> 1.0 in Interval("[0, 1)"), 0 in Interval("[0, 1)"), str(Interval("(0, inf)"))
      (False, True, '> 0')
    """

    spec: str

    def _ends(self) -> tuple[str, float, float, str]:
        low_bracket, low, high, high_bracket = re.fullmatch(
            r"([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])", self.spec
        ).groups()
        return low_bracket, float(low), float(high), high_bracket

    def __contains__(self, value: float) -> bool:
        low_bracket, low, high, high_bracket = self._ends()
        above = value >= low if low_bracket == "[" else value > low
        below = value <= high if high_bracket == "]" else value < high
        return above and below

    def __str__(self) -> str:
        low_bracket, low, high, _ = self._ends()
        if math.isinf(high):
            return f"{'>=' if low_bracket == '[' else '>'} {low:g}"
        return f"in {self.spec}"


# The bounds most fields have.
Count = Annotated[int, Interval("[1, inf)")]  # a number of things: >= 1
NonNegative = Annotated[T, Interval("[0, inf)")]  # NonNegative[int], NonNegative[float]
Positive = Annotated[float, Interval("(0, inf)")]  # a rate or scale: > 0
Dropout = Annotated[float, Interval("[0, 1)")]  # a probability of dropping: [0, 1)


class Checked:
    """Base of the config dataclasses: on construction every field is checked against its type.

    :func:`check_fields` refuses a float that is NaN or infinite, a number outside its
    :class:`Interval` and a string outside its ``Literal`` choices. A config that also checks
    how its fields fit defines ``__post_init__``, calling ``super().__post_init__()`` first; a
    part (a field holding a config) checked itself when it was built. A ``ValueError`` from
    these is a usage error on the command line (:func:`parse_config`).
    """

    def __post_init__(self) -> None:
        check_fields(self)


def check_fields(config: Any) -> None:
    """``ValueError`` naming the first field of ``config`` whose value its type does not allow.

    Example:
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config:
      ...     lr: Positive = 0.1
      ...     mode: Literal["a", "b"] = "a"
      ...     sizes: tuple[Count, ...] = (1,)
      >>> check_fields(Config(lr=float("nan")))
      Traceback (most recent call last):
      ValueError: lr must be finite, got nan
      >>> check_fields(Config(sizes=(2, 0)))
      Traceback (most recent call last):
      ValueError: sizes must be >= 1, got (2, 0)
      >>> check_fields(Config(mode="c"))
      Traceback (most recent call last):
      ValueError: mode must be one of a, b, got 'c'
    """
    hints = typing.get_type_hints(type(config), include_extras=True)
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        items = [v for v in (value if isinstance(value, tuple) else (value,)) if v is not None]
        intervals, choices, optional = _constraints(hints[field.name])
        none = " or None" if optional else ""
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ValueError(f"{field.name} must be finite, got {value}")
        for interval in intervals:
            if not all(v in interval for v in items):
                raise ValueError(f"{field.name} must be {interval}{none}, got {value}")
        if choices and not all(v in choices for v in items):
            raise ValueError(
                f"{field.name} must be one of {', '.join(map(str, choices))}{none}, got {value!r}"
            )


def _constraints(tp: Any) -> tuple[list[Interval], list[Any], bool]:
    """The intervals and ``Literal`` choices in a field's type (also its items' and inside
    ``X | None``), and whether it is optional."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return [], list(args), False
    if origin is Annotated:
        intervals, choices, optional = _constraints(args[0])
        intervals += [m for m in tp.__metadata__ if isinstance(m, Interval)]
        return intervals, choices, optional
    found = [_constraints(arg) for arg in args if arg not in (Ellipsis, type(None))]
    return [i for f in found for i in f[0]], [c for f in found for c in f[1]], type(None) in args


# ----------------------------------------------------------------------------------------------
# Config from the command line


class _TqdmStderr(logging.Handler):
    """Writes each record on the current ``sys.stderr`` through ``tqdm.write``, so that a line
    logged under a progress bar does not tear it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001  (logging's own contract: never raise from emit)
            self.handleError(record)


def show_logs(level: int = logging.INFO) -> None:
    """Shows the library's log lines (``bottleneck.*`` loggers, ``level`` and above) on stderr,
    message only: what a script calls once (:func:`parse_config` does). Idempotent.

    The lines stop at the ``bottleneck`` logger (no propagation to the root logger): importing
    Orbax gives the root a handler of its own, which would print each line a second time.
    """
    logger = logging.getLogger("bottleneck")
    logger.setLevel(level)
    logger.propagate = False
    if not any(isinstance(handler, _TqdmStderr) for handler in logger.handlers):
        handler = _TqdmStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def parse_config(
    config_cls: type[ConfigT],
    presets: Mapping[str, ConfigT] | None = None,
    argv: Sequence[str] | None = None,
) -> ConfigT:
    """The config from a named preset plus flags: ``smoke --optimizer.lr 0.1``.

    The command line is `tyro <https://brentyi.github.io/tyro/>`_'s for ``config_cls``, with
    field names as they are spelled (``--out_dir``): a field holding a dataclass is a group of
    flags (``--optimizer.lr``), a union of dataclasses is a subcommand (``model:transformer``,
    named by each class's ``family``), a tuple takes its items space-separated, ``None`` is
    spelled ``None``, a bool is ``--flag`` / ``--no_flag``. A nested field whose name no other
    field has also answers to that name (``--lr``). A field's help is its comment.

    ``presets`` are config instances by name, each a subcommand that comes first on the line
    (tyro's ``subcommand_type_from_defaults``, as ``overridable_config_cli`` builds it); flags
    override it. ``"default"`` (the dataclass defaults unless ``presets`` defines it) is used
    when none is named. A named preset that keeps the default ``out_dir`` writes to
    ``<out_dir>_<name>``; ``--help`` lists each preset with the flags that make it.

    A malformed or unknown flag or a value the config refuses (:class:`Checked`) ends the script
    with tyro's message, an ``out_dir`` this experiment may not use with one line (``NAME.py:
    error: ...``), both with status 2. The library's log lines go to stderr (:func:`show_logs`).

    Example:
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config(Checked):
      ...     width: Count = 8
      ...     experts: tuple[int, ...] = (2, 4)
      ...     plot: bool = True
      >>> presets = {"big": Config(width=64)}
      >>> parse_config(Config, presets, ["big", "--experts", "3", "5", "--no_plot"])
      Config(width=64, experts=(3, 5), plot=False)
    """
    show_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    cli_type: Any = config_cls
    default: Any = tyro.MISSING_NONPROP
    if presets:
        presets = _with_default_out_dirs(config_cls, presets)
        default = presets[DEFAULT_PRESET]
        cli_type = tyro.extras.subcommand_type_from_defaults(
            presets, descriptions=_preset_descriptions(config_cls, presets)
        )
        if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            argv.insert(0, DEFAULT_PRESET)  # named: tyro then reads --no-plot as --no_plot
    with one_line_errors(config_cls):
        config = tyro.cli(
            cli_type,
            prog=_program(config_cls),
            args=argv,
            default=default,
            description=inspect.getdoc(config_cls) or "",
            use_underscores=True,
            config=(tyro.conf.CascadeSubcommandArgs,),  # a group's flags anywhere on the line
            registry=_short_flags(config_cls),
        )
        if isinstance(getattr(config, "out_dir", None), str):
            check_run_folder(config.out_dir, config)
    return config


@contextlib.contextmanager
def one_line_errors(
    program: Any, statuses: Mapping[type[Exception], int] | None = None
) -> Iterator[None]:
    """Ends the script on a :class:`UsageError` (or an exception in ``statuses``) with one line.

    The line is ``NAME.py: error: MESSAGE`` on stderr, ``NAME.py`` the file that defines
    ``program`` (a config or its class); the exit status is 2 for a usage error, else the one
    ``statuses`` gives the exception's class. A :class:`~bottleneck.runs.folder.TrainingInterrupted`
    run ends quietly with its ``exit_code``, as does output cut short by a closed pipe (status 1);
    Ctrl-C anywhere else ends it with ``NAME.py: interrupted`` and status 130, no traceback.
    """
    statuses = {UsageError: 2, **(statuses or {})}
    try:
        yield
    except tuple(statuses) as err:
        message = " ".join(str(err).split())
        print(f"{_program(program)}: error: {message}", file=sys.stderr)
        status = next(s for cls, s in statuses.items() if isinstance(err, cls))
        raise SystemExit(status) from None
    except TrainingInterrupted as err:  # StopSignals logged the signal; the checkpoint is saved
        raise SystemExit(err.exit_code) from None
    except KeyboardInterrupt:  # Ctrl-C where nothing saves (sampling, a diagnostic), or twice
        print(f"{_program(program)}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # stdout's reader has gone (--help | head): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def _program(program: Any) -> str:
    return Path(inspect.getfile(program if isinstance(program, type) else type(program))).name


def _field_paths(config_cls: type, prefix: str = "") -> Iterator[str]:
    """The dotted names of the fields that are not parts (``optimizer.lr``)."""
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        parts = _parts(hints[field.name])
        if not parts:
            yield prefix + field.name
        for part in parts:
            yield from _field_paths(part, f"{prefix}{field.name}.")


def _with_default_out_dirs(config_cls: type, presets: Mapping[str, Any]) -> dict[str, Any]:
    """``presets`` with ``"default"``; a named one that keeps the default out_dir gets its own."""
    out = {DEFAULT_PRESET: presets.get(DEFAULT_PRESET) or config_cls()}
    out_dir = getattr(out[DEFAULT_PRESET], "out_dir", None)
    for name, preset in presets.items():
        if name != DEFAULT_PRESET and isinstance(out_dir, str) and preset.out_dir == out_dir:
            preset = dataclasses.replace(preset, out_dir=f"{out_dir}_{name.replace('-', '_')}")
        out[name] = preset
    return out


def _short_flags(config_cls: type) -> ConstructorRegistry:
    """A tyro registry giving every nested field whose name is unique a flag of that name."""
    counts = Counter(_leaf_names(config_cls))
    registry, busy = ConstructorRegistry(), []

    @registry.struct_rule
    def short_flags(info: Any) -> Any:
        if busy or info.type is config_cls or not dataclasses.is_dataclass(info.type):
            return None
        busy.append(True)  # the default rule for this dataclass, then add the aliases
        try:
            spec = ConstructorRegistry.get_struct_spec(info)
        finally:
            busy.pop()
        if not isinstance(spec, StructConstructorSpec):
            return spec
        fields = tuple(
            dataclasses.replace(f, type=Annotated[f.type, tyro.conf.arg(aliases=(f"--{f.name}",))])
            if counts[f.name] == 1 and not _parts(f.type) and not _aliases(f.type)
            else f
            for f in spec.fields
        )
        return dataclasses.replace(spec, fields=fields)

    return registry


def _parts(tp: Any) -> list[type]:
    """The config classes a field of type ``tp`` holds: itself, or a union's members."""
    tp = _strip(tp)
    members = typing.get_args(tp) if typing.get_origin(tp) in (Union, UnionType) else (tp,)
    return [t for t in map(_strip, members) if isinstance(t, type) and dataclasses.is_dataclass(t)]


def _strip(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _aliases(tp: Any) -> tuple[str, ...]:
    """The flags a field's type names for it (``Annotated[str, tyro.conf.arg(aliases=...)]``)."""
    metadata = tp.__metadata__ if typing.get_origin(tp) is Annotated else ()
    return sum((tuple(getattr(m, "aliases", None) or ()) for m in metadata), ())


def _leaf_names(config_cls: type) -> Iterator[str]:
    """The names of the fields that are not parts, in ``config_cls`` and all its parts."""
    return (path.rsplit(".", 1)[-1] for path in _field_paths(config_cls))


def _preset_descriptions(config_cls: type, presets: Mapping[str, Any]) -> dict[str, str]:
    """Each preset as the flags that turn the defaults into it (its subcommand's help)."""
    unique = {name for name, n in Counter(_leaf_names(config_cls)).items() if n == 1}
    flags = {
        name: _flags_between(presets[DEFAULT_PRESET], p, unique) for name, p in presets.items()
    }
    return {name: " ".join(f) or "the defaults" for name, f in flags.items()}


def _flags_between(base: Any, config: Any, unique: set[str], prefix: str = "") -> list[str]:
    """The command-line spelling that turns ``base`` into ``config`` (the same class)."""
    flags = []
    hints = typing.get_type_hints(type(config), include_extras=True)
    for field in dataclasses.fields(config):
        old, new = getattr(base, field.name), getattr(config, field.name)
        if dataclasses.is_dataclass(new):
            if type(new) is not type(old):  # another member of a union: its subcommand
                flags.append(f"{prefix}{field.name}:{new.family}")
                old = type(new)()
            flags += _flags_between(old, new, unique, f"{prefix}{field.name}.")
        elif new != old:
            short = field.name in unique and f"--{field.name}"
            flag = (*_aliases(hints[field.name]), short or f"--{prefix}{field.name}")[0]
            if isinstance(new, bool):
                flags.append(flag if new else f"--no_{flag[2:]}")
            else:
                values = new if isinstance(new, tuple) else (new,)
                flags.append(" ".join([flag, *(shlex.quote(str(v)) for v in values)]))
    return flags


# ----------------------------------------------------------------------------------------------
# Tables, plots and progress


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, floatfmt: str = ".4g"
) -> str:
    """``rows`` as a Markdown (pipe) table, through `tabulate <https://pypi.org/project/tabulate/>`_.

    A column whose every value is a number (not a bool) is right-aligned and its floats formatted
    with ``floatfmt``; any other column is text, left-aligned and printed as it is (a string such
    as ``"007"`` stays ``007``). Missing cells and ``None`` are empty.

    Args:
      rows: one mapping per row.
      columns: the columns to show, in order; default: every key, in first-seen order.
      floatfmt: format spec for floats (``format(value, floatfmt)``).

    Example:
      >>> print(markdown_table([{"layer": "dense", "zeros": 61}, {"layer": "moe", "zeros": 0.5}]))
      | layer   |   zeros |
      |:--------|--------:|
      | dense   |      61 |
      | moe     |     0.5 |
    """
    columns = list(columns or dict.fromkeys(key for row in rows for key in row))
    text_columns = [
        i
        for i, c in enumerate(columns)
        if not all(_is_number(row[c]) for row in rows if row.get(c) is not None)
    ]
    return tabulate(
        [[row.get(c) for c in columns] for row in rows],
        headers=columns,
        tablefmt="pipe",
        floatfmt=floatfmt,
        numalign="right",
        stralign="left",
        missingval="",
        disable_numparse=text_columns or False,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files, no window), imported when a script draws
    its first plot: importing it at the start would cost every run of the study script, its
    ``--help`` included, ~0.6 s of CPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def progress(iterable: Iterable[T], total: int | None = None, desc: str | None = None) -> tqdm:
    """Iterate ``iterable`` under a tqdm progress bar (stderr), cleared when the loop ends.

    One place for the experiments' progress-bar settings; the result is the ``tqdm`` object, so
    ``bar.set_postfix(loss=...)`` works.
    """
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
