"""bottleneck.runs.rows: upsert by key, files replaced in one step, CSV round trips."""

import json

import numpy as np
import pytest

from bottleneck.runs import rows


def by_run(row):
    return row["run"]


def test_upsert_replaces_the_row_of_its_key_in_place_or_appends():
    table = [{"run": "a", "x": 1}, {"run": "b", "x": 2}, {"run": "a", "x": 3}]
    assert rows.upsert(table, {"run": "a", "x": 9}, by_run) == [
        {"run": "a", "x": 9},
        {"run": "b", "x": 2},
    ]
    assert rows.upsert(table, {"run": "c", "x": 4}, by_run) == [*table, {"run": "c", "x": 4}]
    assert table[0] == {"run": "a", "x": 1}  # the input is not changed


def test_a_write_that_fails_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "rows.json"
    rows.write_json(path, [{"run": "a"}])
    with pytest.raises(TypeError):
        rows.write_json(path, [{"run": object()}])  # not JSON: fails mid-write
    assert json.loads(path.read_text()) == [{"run": "a"}]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # no temporary file left


def test_csv_round_trip_with_columns_and_missing_values(tmp_path):
    path = tmp_path / "sub" / "rows.csv"
    table = [{"a": 1, "b": None, "c": "x"}, {"a": 2.5, "d": np.int64(3)}]
    rows.write_csv(path, table)
    assert rows.read_csv(path) == [
        {"a": "1", "b": "", "c": "x", "d": ""},
        {"a": "2.5", "b": "", "c": "", "d": "3"},
    ]
    rows.write_csv(path, table, columns=["c", "a"])  # others left out, in this order
    assert path.read_text().splitlines() == ["c,a", "x,1", ",2.5"]
    assert rows.read_csv(tmp_path / "absent.csv") == []
