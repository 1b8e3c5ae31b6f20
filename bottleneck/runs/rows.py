"""An experiment's rows on disk: one store for every script's results.

Rows are dicts, one per run or cell, kept in a JSON or CSV file that a script rewrites as rows
land: :func:`upsert` replaces the row of the same key (a run measured again) or appends it, and
:func:`write_json` / :func:`write_csv` replace the file in one step (a temporary file renamed
over it), so a reader or an interrupted writer never sees half a file.

Example:
  >>> rows = [{"run": "a", "nll": 1.0}, {"run": "b", "nll": 2.0}]
  >>> upsert(rows, {"run": "a", "nll": 0.5}, key=lambda r: r["run"])
  [{'run': 'a', 'nll': 0.5}, {'run': 'b', 'nll': 2.0}]
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any


def upsert(
    rows: Sequence[dict[str, Any]], row: dict[str, Any], key: Callable[[dict[str, Any]], Hashable]
) -> list[dict[str, Any]]:
    """``rows`` with ``row`` in place of every row of its key (at the first one's position), or
    appended."""
    mine = key(row)
    positions = [i for i, r in enumerate(rows) if key(r) == mine]
    if not positions:
        return [*rows, row]
    kept = [r for i, r in enumerate(rows) if i not in positions[1:]]
    first = positions[0]
    return [*kept[:first], row, *kept[first + 1 :]]


def _replace(path: Path, write: Callable[[Any], None]) -> Path:
    """Writes ``path`` through ``write(file)`` into a temporary file, then renames it over
    ``path`` (one step: the old file or the new one, never half of either)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:  # an error or Ctrl-C mid-write: the old file stays, whole
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj: Any, indent: int = 2) -> Path:
    """``obj`` (JSON-ready: see :func:`bottleneck.runs.folder.to_jsonable`) as indented JSON."""
    return _replace(Path(path), lambda f: f.write(json.dumps(obj, indent=indent) + "\n"))


def write_csv(
    path: str | Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None
) -> Path:
    """``rows`` as CSV with ``columns`` (default: the union of the rows' keys, in first-seen
    order; a key outside ``columns`` is left out, a missing one or None written empty)."""
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))

    def write(f: Any) -> None:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})

    return _replace(Path(path), write)


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a CSV file as strings by column (none if the file does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [dict(row) for row in csv.DictReader(f)]
