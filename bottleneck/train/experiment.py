"""The thin layer every experiment script shares: config CLI, run folder, tables, progress bars.

An experiment is a flat script with a config dataclass and a few named presets (big_vision
style). :func:`parse_config` turns the dataclass into a command line (a field holding another
dataclass is a group of flags, ``--optimizer.lr``), :func:`open_run` records the config and writes
results into one output folder, :func:`print_table` prints the summary.

Example script::

    @dataclasses.dataclass(frozen=True)
    class Config:
        width: int = 128
        experts: tuple[int, ...] = (2, 4)
        seed: int = 0
        out_dir: str = "runs/example"

        def validate(self) -> None:
            if self.width < 1:
                raise ValueError(f"width must be >= 1, got {self.width}")

    config = parse_config(Config, {"smoke": {"width": 16}}, sys.argv[1:])
    run = open_run(config.out_dir, config)
    run.log_metrics({"step": 0, "loss": 1.0})
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import inspect
import json
import math
import shlex
import sys
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
from tqdm.auto import tqdm

ConfigT = TypeVar("ConfigT")
T = TypeVar("T")

DEFAULT_PRESET = "default"


# ----------------------------------------------------------------------------------------------
# Config from the command line


class UsageError(ValueError):
    """The command line, or a file or folder it names, cannot be used (scripts exit with 2)."""


def parse_config(
    config_cls: type[ConfigT],
    presets: Mapping[str, ConfigT | Mapping[str, Any]],
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
) -> ConfigT:
    """Build a config from a named preset plus one ``--field value`` flag per dataclass field.

    The flags are derived from the field types: ``int``, ``float``, ``str``, ``bool``
    (``--flag`` / ``--no-flag``), ``tuple[X, ...]`` / ``list[X]`` of those scalars as
    comma-separated values (``--experts 2,4,8``), and ``X | None`` (the value ``none``). A field
    whose type is itself a dataclass is a group of flags: ``--optimizer.lr 20`` sets field
    ``lr`` of field ``optimizer``; ``--help`` lists each group under its name and docstring. A
    nested field whose name (or ``metadata["flag"]``) no other field uses also answers to that
    short name (``--lr 20``). Flags given on the command line override the preset; the preset
    overrides the dataclass defaults. A preset is a config instance or a mapping of overrides
    by dotted name (``{"optimizer.lr": 20.0}``); ``"default"`` (the dataclass defaults unless
    ``presets`` redefines it) is always available and used when ``--preset`` is not given.
    ``--help`` ends with what each preset sets, as flags.

    The result's floats must be finite, and every ``validate()`` method of the config and of its
    groups (innermost first, :func:`validate_config`) is called; a ``ValueError`` from those (or
    from the dataclass constructor) becomes an argparse error: the usage and the message go
    to stderr and the process exits with status 2, as for a malformed flag value.

    Args:
      config_cls: a dataclass type whose fields all have defaults.
      presets: named presets.
      argv: the arguments without the program name; ``None`` for ``sys.argv[1:]``.
      description: shown by ``--help`` (defaults to the config's docstring).

    Returns:
      The config instance.

    Example:
      >>> @dataclasses.dataclass
      ... class Config:
      ...     width: int = 8
      ...     experts: tuple[int, ...] = (2, 4)
      ...     plot: bool = True
      >>> parse_config(Config, {"big": {"width": 64}}, ["--preset", "big", "--experts", "3,5"])
      Config(width=64, experts=(3, 5), plot=True)
    """
    if not dataclasses.is_dataclass(config_cls) or not isinstance(config_cls, type):
        raise TypeError(f"config_cls must be a dataclass type, got {config_cls!r}")
    # "default" is the dataclass defaults (no overrides) unless the script defines it.
    presets = {DEFAULT_PRESET: {}, **presets}
    flags = _flags(config_cls)
    defaults = config_cls()
    # Every preset is built now: a preset naming no field fails here, whichever is chosen.
    preset_configs = {name: _preset_config(config_cls, p, name) for name, p in presets.items()}

    parser = argparse.ArgumentParser(
        usage="%(prog)s [-h] [--preset NAME] [--FLAG VALUE ...]",
        description=description or config_cls.__doc__,
        epilog=_presets_help(flags, defaults, preset_configs),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        choices=sorted(presets),
        help="named starting point (what each sets: below); the flags override it",
    )
    groups: dict[str, Any] = {}
    for flag in flags:
        container = parser
        if flag.group:
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(
                    flag.group, _docstring_summary(type(_get(defaults, flag.group)))
                )
            container = groups[flag.group]
        _add_flag(container, flag, _get(defaults, flag.dest))
    args = parser.parse_args(argv)

    overrides = {flag.dest: getattr(args, flag.dest) for flag in flags if hasattr(args, flag.dest)}
    try:
        config = replace_fields(preset_configs[args.preset], overrides)
        validate_config(config)
        if isinstance(getattr(config, "out_dir", None), str):
            check_run_folder(config.out_dir, config)
    except ValueError as err:
        # A bad combination of values is a usage error like a malformed flag: exit status 2.
        parser.error(f"invalid config (preset {args.preset!r}): {err}")
    return config


def replace_fields(config: ConfigT, changes: Mapping[str, Any]) -> ConfigT:
    """``config`` with the fields named by dotted paths replaced.

    Example:
      >>> @dataclasses.dataclass(frozen=True)
      ... class Optimizer:
      ...     lr: float = 1.0
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config:
      ...     optimizer: Optimizer = Optimizer()
      ...     seed: int = 0
      >>> replace_fields(Config(), {"optimizer.lr": 0.5, "seed": 3})
      Config(optimizer=Optimizer(lr=0.5), seed=3)
    """
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in changes.items():
        name, _, rest = path.partition(".")
        if rest:
            nested.setdefault(name, {})[rest] = value
        else:
            direct[name] = value
    names = {field.name for field in dataclasses.fields(config)}
    unknown = sorted((direct.keys() | nested.keys()) - names)
    if unknown:
        raise TypeError(f"{type(config).__name__} has no field(s) {unknown}")
    for name, sub in nested.items():
        direct[name] = replace_fields(getattr(config, name), sub)
    return dataclasses.replace(config, **direct)


def config_from_jsonable(config_cls: type[ConfigT], tree: Mapping[str, Any]) -> ConfigT:
    """The config that :func:`to_jsonable` turned into ``tree`` (``config.json``'s ``"config"``).

    Fields that ``tree`` lacks keep their defaults (a run recorded before they existed); a field
    that ``config_cls`` does not have is a ``ValueError`` naming it (a run of another version).
    JSON's lists become tuples again for tuple fields. The result is not validated.

    Example:
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config:
      ...     lr: float = 1.0
      ...     widths: tuple[int, ...] = (8,)
      >>> config_from_jsonable(Config, {"widths": [4, 8]})
      Config(lr=1.0, widths=(4, 8))
    """
    flags = {flag.dest: flag for flag in _flags(config_cls)}
    values = _dotted(tree)
    unknown = sorted(set(values) - set(flags))
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field(s) {', '.join(unknown)}")
    return replace_fields(
        config_cls(),
        {
            name: tuple(value)
            if isinstance(value, list) and typing.get_origin(flags[name].type) is tuple
            else value
            for name, value in values.items()
        },
    )


def validate_config(config: Any) -> None:
    """``ValueError`` unless every float is finite and every part's ``validate()`` passes.

    Parts (fields holding a dataclass) are checked before the config that holds them, so a
    config's own ``validate()`` may rely on its parts being valid and check only how they fit.
    """
    check_finite_floats(config)
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            validate_config(value)
    validate = getattr(config, "validate", None)
    if callable(validate):
        validate()


def check_finite_floats(config: Any, prefix: str = "") -> None:
    """``ValueError`` naming the first float field (or item of a float tuple) that is NaN or inf.

    A NaN learning rate would otherwise train to NaN and report plausible-looking tables. Parts
    are searched too and named by their dotted path (``optimizer.lr``).
    """
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            check_finite_floats(value, f"{prefix}{field.name}.")
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        for item in values:
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"{prefix}{field.name} must be finite, got {value}")


def _preset_config(
    config_cls: type[ConfigT], preset: ConfigT | Mapping[str, Any], name: str = DEFAULT_PRESET
) -> ConfigT:
    """A preset as a config instance: instances are used as they are, mappings override defaults.

    A named preset that keeps the default ``out_dir`` gets its own, ``<out_dir>_<name>``, so
    that ``--preset smoke`` never overwrites the results of the default run.
    """
    if isinstance(preset, config_cls):
        return preset
    if not isinstance(preset, Mapping):
        raise TypeError(f"a preset must be a {config_cls.__name__} or a mapping, got {preset!r}")
    config = replace_fields(config_cls(), preset)
    default_out_dir = getattr(config_cls, "out_dir", None)
    if name != DEFAULT_PRESET and "out_dir" not in preset and isinstance(default_out_dir, str):
        config = dataclasses.replace(config, out_dir=f"{default_out_dir}_{name.replace('-', '_')}")
    return config


@dataclasses.dataclass(frozen=True)
class _Flag:
    """One leaf field as a flag: ``--<dest>`` and, when unique, ``--<short>``."""

    dest: str  # dotted path from the config, e.g. "optimizer.lr"
    group: str  # dotted path of the part holding it; "" at the top level
    field: dataclasses.Field
    type: Any
    short: str | None = None

    @property
    def names(self) -> list[str]:
        """The option strings, the short one first (the one people type)."""
        return [f"--{name}" for name in dict.fromkeys(filter(None, (self.short, self.dest)))]


def _flags(config_cls: type) -> list[_Flag]:
    """Every leaf field of ``config_cls`` and its parts, depth first, with its short name."""

    def leaves(cls: type, prefix: str) -> list[_Flag]:
        out = []
        types_ = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            tp = types_[field.name]
            if dataclasses.is_dataclass(tp) and isinstance(tp, type):
                out += leaves(tp, f"{prefix}{field.name}.")
            else:
                out.append(_Flag(prefix + field.name, prefix[:-1], field, tp))
        return out

    flags = leaves(config_cls, "")
    wanted = [flag.field.metadata.get("flag", flag.field.name) for flag in flags]
    dests = {flag.dest for flag in flags}
    return [
        dataclasses.replace(flag, short=short)
        if wanted.count(short) == 1 and (short == flag.dest or short not in dests)
        else flag
        for flag, short in zip(flags, wanted, strict=True)
    ]


def _get(config: Any, path: str) -> Any:
    for name in filter(None, path.split(".")):
        config = getattr(config, name)
    return config


def _docstring_summary(cls: type) -> str | None:
    """The first paragraph of a part's docstring (not the signature dataclasses writes)."""
    doc = inspect.getdoc(cls)
    if not doc or doc.startswith(f"{cls.__name__}("):
        return None
    return doc.split("\n\n")[0].replace("\n", " ")


def _add_flag(parser: Any, flag: _Flag, default: Any) -> None:
    """Add the flag's option strings to ``parser`` (a parser or an argument group)."""
    help_text = f"{flag.field.metadata.get('help', '')} (default: {_format_value(default)})"
    # SUPPRESS: a flag that is not given leaves no attribute, so the preset's value stays.
    if flag.type is bool:
        parser.add_argument(
            *flag.names,
            dest=flag.dest,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help=help_text.strip(),
        )
        return
    parser.add_argument(
        *flag.names,
        dest=flag.dest,
        type=_value_parser(flag.type, flag.dest),
        default=argparse.SUPPRESS,
        metavar=_metavar(flag.type),
        help=help_text.strip(),
    )


def _presets_help(flags: list[_Flag], defaults: Any, presets: Mapping[str, Any]) -> str:
    """``--help``'s last section: each preset as the flags that turn the defaults into it."""
    lines = ["presets (--preset NAME) and the flags they set:"]
    width = max(len(name) for name in presets)
    for name, preset in presets.items():
        changed = [
            _as_flag(flag, _get(preset, flag.dest))
            for flag in flags
            if _get(preset, flag.dest) != _get(defaults, flag.dest)
        ]
        line = f"  {name.ljust(width)} "
        for item in changed or ["(the defaults)"]:  # a flag and its value stay on one line
            if len(line) + 1 + len(item) > 100 and line.strip() != name:
                lines.append(line)
                line = " " * (width + 3)
            line += f" {item}"
        lines.append(line)
    return "\n".join(lines)


def _as_flag(flag: _Flag, value: Any) -> str:
    """The command-line spelling that sets ``flag`` to ``value``."""
    option = flag.names[0]
    if isinstance(value, bool):
        return option if value else f"--no-{option[2:]}"
    return f"{option} {shlex.quote(_format_value(value))}"


def _format_value(value: Any) -> str:
    if value is None:
        return "none"
    if value == "":
        return "''"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def _value_parser(tp: Any, name: str) -> Callable[[str], Any]:
    """A function from the flag's text to a value of type ``tp``; raises ``ArgumentTypeError``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        parse_inner = _value_parser(inner, name)
        return lambda text: None if text.strip().lower() == "none" else parse_inner(text)
    if tp in (int, float, str, bool):
        return _scalar_parser(tp)
    if origin in (tuple, list):
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            item_types, length = (args[0],), None
        elif origin is tuple and args:
            item_types, length = args, len(args)
        else:
            item_types, length = (args[0] if args else str,), None
        for item in item_types:
            if item not in (int, float, str, bool):
                raise TypeError(f"field {name!r}: unsupported item type {item!r} in {tp!r}")
        return _sequence_parser(origin, item_types, length)
    raise TypeError(f"field {name!r}: unsupported type {tp!r} for a command-line flag")


def _scalar_parser(tp: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if tp is str:
            return text
        text = text.strip()
        if tp is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
        try:
            return tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {tp.__name__}, got {text!r}") from None

    return parse


def _sequence_parser(
    origin: type, item_types: tuple[type, ...], length: int | None
) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        # Tolerate the Python spelling "(2, 4)" / "[2, 4]" as well as "2,4"; "" is empty.
        text = text.strip().strip("()[]")
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        if items and items[-1] == "":  # A trailing comma, as in "(2,)".
            items.pop()
        if length is not None and len(items) != length:
            raise argparse.ArgumentTypeError(
                f"expected {length} comma-separated values, got {len(items)} in {text!r}"
            )
        types_ = item_types if length is not None else item_types * len(items)
        values = []
        for item, item_type in zip(items, types_, strict=True):
            try:
                values.append(_scalar_parser(item_type)(item))
            except argparse.ArgumentTypeError as err:
                raise argparse.ArgumentTypeError(
                    f"expected comma-separated {item_type.__name__} values; {err}"
                ) from None
        return origin(values)

    return parse


def _metavar(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return "|".join(_metavar(a) if a is not type(None) else "none" for a in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return ",".join(_metavar(a) for a in args)
    if origin in (tuple, list):
        item = args[0] if args else str
        return f"{getattr(item, '__name__', 'X').upper()},..."
    return getattr(tp, "__name__", "VALUE").upper()


# ----------------------------------------------------------------------------------------------
# Run folder


def to_jsonable(obj: Any) -> Any:
    """``obj`` with dataclasses, tuples, paths, NumPy/JAX arrays and scalars made JSON-friendly."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
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
        path = self.path(name)
        path.write_text(json.dumps(to_jsonable(obj), indent=2) + "\n")
        return path

    def write_csv(self, name: str, rows: Sequence[Mapping[str, Any]]) -> Path:
        """Write ``rows`` as CSV; the columns are the union of the rows' keys, in first-seen order."""
        columns = _columns(rows)
        path = self.path(name)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for row in rows:
                writer.writerow(to_jsonable(dict(row)))
        return path


class RunFolderError(UsageError):
    """An output folder that cannot be used: a file, unwritable, another experiment's run, a
    checkpointed run with another config, or (:class:`~bottleneck.train.checkpoint.RunFolderBusy`)
    a folder in use."""


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
    parts by their dotted names; a field named in ``may_change``, or inside a part named there,
    may differ (say, the epoch budget or the final evaluation's options).
    """
    path = Path(root) / "config.json"
    if not path.is_file():
        return
    saved = _dotted(json.loads(path.read_text()).get("config", {}))
    changed = [
        f"{name}: {saved.get(name)!r} -> {value!r}"
        for name, value in _dotted(to_jsonable(config)).items()
        if not _free(name, may_change) and saved.get(name) != value
    ]
    if changed:
        raise RunFolderError(
            f"{root} holds a checkpointed run with a different config ({'; '.join(changed)}); "
            "rerun with the same flags to resume it, or choose another --out_dir"
        )


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
    (``dataclasses.asdict``), its ``seed`` field (if any) at the top level, the JAX version and
    backend, a UTC timestamp and the command line, so that a result can be traced back to how it
    was made. A folder of another experiment is refused (:func:`check_run_folder`).

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
        },
    )
    return run


# ----------------------------------------------------------------------------------------------
# Printing


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    floatfmt: str = ".4g",
    *,
    file: Any = None,
) -> str:
    """Print ``rows`` as a fixed-width Markdown table and return it.

    Numbers are right-aligned, floats formatted with ``floatfmt``, missing cells left empty.

    Args:
      rows: one mapping per row.
      columns: the columns to show, in order; default: every key, in first-seen order.
      floatfmt: format spec for floats (``format(value, floatfmt)``).
      file: where to print (default ``sys.stdout``).

    Returns:
      The table, without a trailing newline.

    Example:
      >>> _ = print_table([{"layer": "dense", "zeros": 61}, {"layer": "moe", "zeros": 0.5}])
      | layer | zeros |
      |:------|------:|
      | dense |    61 |
      | moe   |   0.5 |
    """
    columns = list(columns) if columns is not None else _columns(rows)
    cells = [[_format_cell(row.get(c, ""), floatfmt) for c in columns] for row in rows]
    numeric = [
        all(isinstance(row.get(c), (int, float, np.number)) for row in rows if c in row)
        and any(c in row for row in rows)
        for c in columns
    ]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        ":" + "-" * (w + 1) if not right else "-" * (w + 1) + ":"
        for w, right in zip(widths, numeric, strict=True)
    )
    table = "\n".join([line(columns), rule + "|", *(line(r) for r in cells)])
    print(table, file=file or sys.stdout)
    return table


def _format_cell(value: Any, floatfmt: str) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (float, np.floating)):
        return "nan" if math.isnan(value) else format(float(value), floatfmt)
    return str(value)


def _columns(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The union of the rows' keys, in first-seen order."""
    return list(dict.fromkeys(key for row in rows for key in row))


def progress(iterable: Iterable[T], total: int | None = None, desc: str | None = None) -> tqdm:
    """Iterate ``iterable`` under a tqdm progress bar (stderr), cleared when the loop ends.

    One place for the experiments' progress-bar settings; the result is the ``tqdm`` object, so
    ``bar.set_postfix(loss=...)`` works.
    """
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
