"""Run folders: open_run / RunDir, the refusals, check_resumable, configs to JSON and back."""

import csv
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cli import Config, Large, Nested, Optimizer, Small

from bottleneck.runs import RunDir, RunFolderError, code_commit, open_run
from bottleneck.runs.folder import (
    SPEED_ENVIRONMENT,
    check_resumable,
    config_changes,
    config_from_jsonable,
    cpu_model,
    machine_description,
    to_jsonable,
)


def test_a_union_member_is_recorded_under_its_family_and_read_back(tmp_path):
    config = Nested(Optimizer(0.5, "adam"), Large(depth=3), seed=2)
    tree = to_jsonable(config)
    assert tree["model"] == "large" and tree["large"] == {"depth": 3} and "small" not in tree
    run = open_run(tmp_path, config)
    recorded = json.loads((run.root / "config.json").read_text())["config"]
    assert config_from_jsonable(Nested, recorded) == config
    del recorded["large"]["depth"], recorded["seed"]  # a run from before those fields existed
    assert config_from_jsonable(Nested, recorded) == Nested(Optimizer(0.5, "adam"), Large())
    # A record of when every family had its group: the other family's is not read.
    old = {**to_jsonable(Nested()), "large": {"depth": 7}}
    assert config_from_jsonable(Nested, old) == Nested()
    flat = Config(experts=(3, 5), pair=(2, 0.5))
    assert config_from_jsonable(Config, json.loads(json.dumps(to_jsonable(flat)))) == flat
    with pytest.raises(ValueError, match=r"unknown field\(s\) small.depth$"):
        config_from_jsonable(Nested, {"model": "small", "small": {"depth": 2}})
    with pytest.raises(ValueError, match=r"unknown field\(s\) tag, tags$"):
        config_from_jsonable(Nested, {"tag": "x", "tags": []})
    with pytest.raises(ValueError, match="width must be >= 1"):  # it checks itself
        config_from_jsonable(Nested, {"model": "small", "small": {"width": 0}})


def test_check_resumable_compares_dotted_fields_but_those_that_may_change(tmp_path):
    open_run(tmp_path, Nested())
    check_resumable(tmp_path, Nested())
    check_resumable(tmp_path, Nested(optimizer=Optimizer(lr=0.2)), may_change=["optimizer"])
    with pytest.raises(RunFolderError, match=r"different config \(small.width: 8 -> 9\)"):
        check_resumable(tmp_path, Nested(model=Small(width=9)), may_change=["optimizer.lr"])
    with pytest.raises(RunFolderError, match=r"model: 'small' -> 'large'; large.depth: None -> 12"):
        check_resumable(tmp_path, Nested(model=Large()))
    check_resumable(tmp_path / "new", Nested(seed=5))  # no recorded run: nothing to compare


def test_config_changes_names_each_changed_field_of_a_record():
    recorded = to_jsonable(Nested())
    assert config_changes(recorded, Nested()) == []
    assert config_changes(recorded, Nested(optimizer=Optimizer(lr=0.2), seed=4)) == [
        "optimizer.lr: 0.1 -> 0.2",
        "seed: 0 -> 4",
    ]
    assert config_changes(recorded, Nested(seed=4), may_change=("seed",)) == []


def test_a_folder_of_another_experiment_is_refused(tmp_path):
    run = open_run(tmp_path / "mine", Config())
    record = json.loads((run.root / "config.json").read_text())
    assert record["experiment"] == "test_cli"  # the file that defines Config
    open_run(tmp_path / "mine", Config(width=3))  # the same experiment may reuse it

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"experiment": "language_model"}))
    (other / "results.json").write_text("{}")
    with pytest.raises(RunFolderError, match="holds a run of language_model, not of test_cli"):
        open_run(other, Config())
    assert json.loads((other / "config.json").read_text()) == {"experiment": "language_model"}

    legacy = tmp_path / "legacy"  # a config.json that names no experiment: refused too
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({"config": {}}))
    with pytest.raises(RunFolderError, match="an unknown experiment"):
        open_run(legacy, Config())


def test_an_out_dir_that_is_a_file_is_one_clear_error(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(RunFolderError, match="exists and is not a folder"):
        open_run(path, Config())
    with pytest.raises(RunFolderError, match=f"cannot be created: {path} is not a folder"):
        open_run(path / "sub" / "run", Config())


def test_open_run_writes_config(tmp_path):
    config = Config(width=3, seed=7)
    run = open_run(tmp_path / "a" / "b", config)
    assert isinstance(run, RunDir) and run.root.is_dir()
    record = json.loads((run.root / "config.json").read_text())
    assert record["config"]["width"] == 3
    assert record["config"]["experts"] == [2, 4]
    assert record["seed"] == 7
    assert record["jax_version"] == jax.__version__
    assert record["timestamp"] and record["command"] and record["argv"]
    assert record["commit"] == code_commit()


def test_log_metrics_appends_json_lines(tmp_path):
    run = open_run(tmp_path, Config())
    run.log_metrics({"step": 0, "loss": jnp.float32(1.5)})
    # Readable immediately: each call flushes.
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    run.log_metrics({"step": 1, "loss": np.float64(0.5), "sv": jnp.arange(3.0)})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 0, "loss": 1.5}, {"step": 1, "loss": 0.5, "sv": [0.0, 1.0, 2.0]}]
    # A new run in the same folder starts a new metrics file; resume keeps it.
    open_run(tmp_path, Config(), resume=True)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    open_run(tmp_path, Config())
    assert not (tmp_path / "metrics.jsonl").exists()


def test_write_json_csv_and_path(tmp_path):
    run = open_run(tmp_path, Config())
    path = run.write_json("sub/results.json", {"values": np.arange(2), "config": Config()})
    assert path == tmp_path / "sub" / "results.json"
    assert json.loads(path.read_text())["values"] == [0, 1]
    rows = [{"layer": "dense", "k": 1}, {"layer": "moe", "k": 2, "extra": 0.5}]
    with run.write_csv("results.csv", rows).open() as f:
        read = list(csv.DictReader(f))
    assert read == [
        {"layer": "dense", "k": "1", "extra": ""},
        {"layer": "moe", "k": "2", "extra": "0.5"},
    ]
    assert run.path("plots/a.png") == tmp_path / "plots" / "a.png"
    assert (tmp_path / "plots").is_dir()


def test_to_jsonable_refuses_what_json_cannot_hold():
    assert to_jsonable({"a": (1, 2.5), "b": None}) == {"a": [1, 2.5], "b": None}
    with pytest.raises(TypeError, match="cannot write object as JSON"):
        to_jsonable(object())


def test_a_results_page_names_its_command_commit_and_machine(tmp_path):
    page = RunDir(tmp_path).write_page("page.md", "Ranks", "| d | rank |\n|--:|--:|\n| 4 | 6 |\n")
    lines = page.read_text().splitlines()
    assert lines[0] == "# Ranks"
    header = lines[2]
    assert header.startswith("Written by `python ")
    assert f"at commit `{code_commit()}` on " in header
    assert f"JAX {jax.__version__} on {jax.default_backend()}" in header
    assert lines[4:] == ["| d | rank |", "|--:|--:|", "| 4 | 6 |"]


def test_a_results_page_names_the_settings_that_move_its_speed(monkeypatch):
    for name in SPEED_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert "=" not in machine_description()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    monkeypatch.setenv("XLA_FLAGS", "")  # set but empty: nothing to say
    assert machine_description().endswith("; GLIBC_TUNABLES=glibc.malloc.hugetlb=1")


def test_a_runs_page_names_the_command_and_commit_recorded_when_it_started(tmp_path):
    run = open_run(tmp_path / "run", Config(width=3))
    record = json.loads((run.root / "config.json").read_text())
    record.update(commit="0123456789ab", argv=["experiments/example.py", "--width", "3"])
    (run.root / "config.json").write_text(json.dumps(record))  # as if the checkout moved on
    header = run.write_page("page.md", "Widths", "body").read_text().splitlines()[2]
    assert header.startswith("Written by `python experiments/example.py --width 3` at commit ")
    assert "`0123456789ab`" in header


def test_code_commit_is_the_checkouts_head_or_unknown():
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        assert code_commit() == "unknown"
        return
    assert code_commit().removesuffix("-dirty") == head[:12]


def test_code_commit_of_a_copy_inside_another_repository_is_unknown(tmp_path):
    # An installed copy (site-packages) may sit inside some other project's checkout: that
    # project's commit would be a plausible, wrong record of this code.
    other = tmp_path / "other_project"
    package = pathlib.Path(__file__).resolve().parents[2] / "bottleneck"
    shutil.copytree(package, other / "site-packages" / "bottleneck")
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(
        ["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@t",
         "commit", "-q", "--allow-empty", "-m", "x"],
        check=True,
    )  # fmt: skip
    code = "import bottleneck.runs.folder as r; print(r.code_commit())"
    printed = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(other / "site-packages")},
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert printed[-1] == "unknown"


def test_cpu_model_names_the_family_and_model_a_brand_alone_hides(tmp_path):
    """Two CPU generations that a virtual machine names alike ("AMD EPYC") get different
    names, and so do cells of the study that trained on them."""

    def cpuinfo(family, model):
        block = f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\n"
        block += f"model\t\t: {model}\nmodel name\t: AMD EPYC\nstepping\t: 1\n\n"
        path = tmp_path / f"cpuinfo-{family}-{model}"
        path.write_text(block.format(0) + block.format(1))
        return path

    zen5, zen3 = cpu_model(cpuinfo(26, 2)), cpu_model(cpuinfo(25, 1))
    assert zen5 == "AMD EPYC, family 26 model 2" and zen3 == "AMD EPYC, family 25 model 1"
    brand_only = tmp_path / "brand-only"
    brand_only.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert cpu_model(brand_only) == "Some CPU"
    assert cpu_model(tmp_path / "absent") == (platform.processor() or platform.machine())
