"""parse_config, config_from_jsonable, open_run / RunDir, print_table, progress."""

import csv
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bottleneck.train import (
    RunDir,
    RunFolderError,
    config_from_jsonable,
    open_run,
    parse_config,
    print_table,
    progress,
)
from bottleneck.train.experiment import check_resumable, replace_fields, to_jsonable


@dataclasses.dataclass(frozen=True)
class Config:
    """A config with one field of every supported kind."""

    width: int = 8
    lr: float = 0.1
    name: str = "run"
    plot: bool = True
    experts: tuple[int, ...] = (2, 4)
    scales: tuple[float, ...] = (1.0,)
    tags: list[str] = dataclasses.field(default_factory=lambda: ["a"])
    pair: tuple[int, float] = (1, 2.0)
    limit: int | None = None
    seed: int = 0
    out_dir: str = "runs/test"

    def validate(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if any(k < 1 for k in self.experts):
            raise ValueError(f"experts must all be >= 1, got {self.experts}")


PRESETS = {
    "smoke": {"width": 2, "experts": (1,)},
    "big": Config(width=64, lr=0.5),
}


def test_defaults_without_flags():
    assert parse_config(Config, PRESETS, []) == Config()


def test_preset_then_flags_override():
    config = parse_config(Config, PRESETS, ["--preset", "smoke", "--lr", "0.25"])
    assert config == Config(width=2, experts=(1,), lr=0.25, out_dir="runs/test_smoke")
    config = parse_config(Config, PRESETS, ["--preset", "big", "--width", "3"])
    assert config == Config(width=3, lr=0.5)


def test_every_field_type_parses():
    config = parse_config(
        Config,
        PRESETS,
        [
            "--width=5",
            "--lr",
            "1e-3",
            "--name",
            "a b",
            "--no-plot",
            "--experts",
            "2, 4,8",
            "--scales",
            "0.5,2",
            "--tags",
            "x,y",
            "--pair",
            "(3, 4.5)",
            "--limit",
            "7",
            "--out_dir",
            "/tmp/somewhere",
        ],
    )
    assert config == Config(
        width=5,
        lr=1e-3,
        name="a b",
        plot=False,
        experts=(2, 4, 8),
        scales=(0.5, 2.0),
        tags=["x", "y"],
        pair=(3, 4.5),
        limit=7,
        out_dir="/tmp/somewhere",
    )
    assert isinstance(config.experts, tuple) and isinstance(config.tags, list)
    assert parse_config(Config, PRESETS, ["--limit", "none"]).limit is None
    assert parse_config(Config, PRESETS, ["--experts", ""]).experts == ()
    assert parse_config(Config, PRESETS, ["--preset", "big", "--plot"]).plot is True


def test_default_preset_can_be_redefined():
    config = parse_config(Config, {"default": {"width": 4}}, [])
    assert config.width == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "nope"], "invalid choice: 'nope'"),
        (["--width", "abc"], "argument --width: expected int, got 'abc'"),
        (["--experts", "2,x"], "argument --experts: expected comma-separated int values"),
        (["--pair", "1,2,3"], "expected 2 comma-separated values"),
        (["--unknown", "1"], "unrecognized arguments: --unknown"),
        (["--width", "0"], "width must be >= 1, got 0"),
        (["--experts", "2,0"], "experts must all be >= 1, got (2, 0)"),
    ],
)
def test_bad_values_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Config, PRESETS, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("usage:")


def test_a_named_preset_gets_its_own_default_out_dir():
    # A mapping preset that keeps the default folder gets "<default>_<name>" (so a smoke run
    # never replaces the default run's results); --out_dir and a preset's own folder win.
    assert parse_config(Config, PRESETS, ["--preset", "smoke"]).out_dir == "runs/test_smoke"
    assert parse_config(Config, PRESETS, []).out_dir == "runs/test"
    argv = ["--preset", "smoke", "--out_dir", "elsewhere"]
    assert parse_config(Config, PRESETS, argv).out_dir == "elsewhere"
    presets = {"x-y": {"out_dir": "mine"}, "z-w": {}}
    assert parse_config(Config, presets, ["--preset", "x-y"]).out_dir == "mine"
    assert parse_config(Config, presets, ["--preset", "z-w"]).out_dir == "runs/test_z_w"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "nan"], "lr must be finite, got nan"),
        (["--lr", "inf"], "lr must be finite, got inf"),
        (["--lr=-inf"], "lr must be finite, got -inf"),
        (["--scales", "1.0,nan"], "scales must be finite, got (1.0, nan)"),
        (["--pair", "1,nan"], "pair must be finite, got (1, nan)"),
    ],
)
def test_non_finite_floats_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Config, PRESETS, argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """How to step."""

    lr: float = 0.1
    name: str = dataclasses.field(default="sgd", metadata={"flag": "optimizer"})

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class Model:
    width: int = 8
    lr: float = 1.0  # a second "lr": both answer to their dotted names only


@dataclasses.dataclass(frozen=True)
class Nested:
    """A config with parts."""

    optimizer: Optimizer = Optimizer()
    model: Model = Model()
    seed: int = 0
    out_dir: str = "runs/nested"

    def validate(self) -> None:
        if self.model.width < self.seed:
            raise ValueError("width must be >= seed")


NESTED_PRESETS = {"wide": {"model.width": 64, "optimizer.name": "adam"}}


def test_parts_are_groups_of_dotted_flags_with_unique_short_names():
    config = parse_config(Nested, NESTED_PRESETS, ["--preset", "wide", "--optimizer.lr", "0.5"])
    assert config == Nested(Optimizer(0.5, "adam"), Model(width=64), out_dir="runs/nested_wide")
    # A field's short name (or its metadata "flag") works where no other field claims it.
    assert parse_config(Nested, {}, ["--width", "3", "--optimizer", "adam"]) == parse_config(
        Nested, {}, ["--model.width", "3", "--optimizer.name", "adam"]
    )
    assert parse_config(Nested, {}, ["--model.lr", "2"]).model.lr == 2.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "1"], "unrecognized arguments: --lr"),  # two fields are called lr
        (["--optimizer.lr", "nan"], "optimizer.lr must be finite, got nan"),
        (["--optimizer.lr", "0"], "lr must be > 0, got 0.0"),  # the part's validate()
        (["--seed", "9"], "width must be >= seed"),  # the config's, after its parts'
    ],
)
def test_nested_values_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Nested, NESTED_PRESETS, argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_shows_the_groups_and_what_each_preset_sets(capsys):
    with pytest.raises(SystemExit):
        parse_config(Nested, {**NESTED_PRESETS, "big": Nested(seed=2)}, ["--help"])
    text = capsys.readouterr().out
    assert "\noptimizer:\n  How to step.\n" in text and "\nmodel:\n" in text
    assert "--width INT, --model.width INT" in text and "--model.lr FLOAT" in text
    presets = text[text.index("presets (--preset NAME)") :].splitlines()
    assert presets[1:] == [
        "  default  (the defaults)",
        "  wide     --optimizer adam --width 64 --out_dir runs/nested_wide",
        "  big      --seed 2",
    ]


def test_replace_fields_and_presets_name_fields_that_exist():
    config = replace_fields(Nested(), {"model.width": 2, "seed": 1})
    assert config == Nested(model=Model(width=2), seed=1)
    with pytest.raises(TypeError, match=r"Model has no field\(s\) \['depth'\]"):
        replace_fields(Nested(), {"model.depth": 2})
    with pytest.raises(TypeError, match="has no field"):  # any preset, whichever is chosen
        parse_config(Nested, {"typo": {"optimiser.lr": 1.0}}, [])


def test_a_recorded_config_is_read_back_with_defaults_for_fields_it_lacks(tmp_path):
    config = Nested(Optimizer(0.5, "adam"), Model(width=3), seed=2)
    run = open_run(tmp_path, config)
    recorded = json.loads((run.root / "config.json").read_text())["config"]
    assert config_from_jsonable(Nested, recorded) == config
    del recorded["model"]["lr"], recorded["seed"]  # a run from before those fields existed
    assert config_from_jsonable(Nested, recorded) == Nested(Optimizer(0.5, "adam"), Model(3))
    flat = Config(experts=(3, 5), pair=(2, 0.5))
    assert config_from_jsonable(Config, json.loads(json.dumps(to_jsonable(flat)))) == flat
    with pytest.raises(ValueError, match=r"Nested has no field\(s\) model.depth, tag"):
        config_from_jsonable(Nested, {"model": {"depth": 2}, "tag": "x"})


def test_check_resumable_compares_dotted_fields_but_those_that_may_change(tmp_path):
    open_run(tmp_path, Nested())
    check_resumable(tmp_path, Nested())
    check_resumable(tmp_path, Nested(optimizer=Optimizer(lr=0.2)), may_change=["optimizer"])
    with pytest.raises(RunFolderError, match=r"different config \(model.width: 8 -> 9\)"):
        check_resumable(tmp_path, Nested(model=Model(width=9)), may_change=["optimizer.lr"])
    check_resumable(tmp_path / "new", Nested(seed=5))  # no recorded run: nothing to compare


def test_a_folder_of_another_experiment_is_refused(tmp_path, capsys):
    run = open_run(tmp_path / "mine", Config())
    record = json.loads((run.root / "config.json").read_text())
    assert record["experiment"] == "test_experiment"  # the file that defines Config
    open_run(tmp_path / "mine", Config(width=3))  # the same experiment may reuse it

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"experiment": "language_model"}))
    (other / "results.json").write_text("{}")
    with pytest.raises(RunFolderError, match="holds a run of language_model, not of test_exp"):
        open_run(other, Config())
    assert json.loads((other / "config.json").read_text()) == {"experiment": "language_model"}
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Config, PRESETS, ["--out_dir", str(other)])
    assert exit_info.value.code == 2
    assert "holds a run of language_model" in capsys.readouterr().err

    legacy = tmp_path / "legacy"  # a config.json that names no experiment: refused too
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({"config": {}}))
    with pytest.raises(RunFolderError, match="an unknown experiment"):
        open_run(legacy, Config())


def test_an_out_dir_that_is_a_file_is_one_clear_error(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(RunFolderError, match="exists and is not a folder"):
        open_run(path, Config())
    with pytest.raises(RunFolderError, match=f"cannot be created: {path} is not a folder"):
        open_run(path / "sub" / "run", Config())
    for out_dir, message in (
        (path, "exists and is not a folder"),
        (path / "x", "cannot be created"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_config(Config, PRESETS, ["--out_dir", str(out_dir)])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_unsupported_field_type_is_a_programming_error():
    @dataclasses.dataclass
    class Odd:
        mapping: dict[str, int] = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match="mapping"):
        parse_config(Odd, {}, [])


def test_open_run_writes_config(tmp_path):
    config = Config(width=3, seed=7)
    run = open_run(tmp_path / "a" / "b", config)
    assert isinstance(run, RunDir) and run.root.is_dir()
    record = json.loads((run.root / "config.json").read_text())
    assert record["config"]["width"] == 3
    assert record["config"]["experts"] == [2, 4]
    assert record["seed"] == 7
    assert record["jax_version"] == jax.__version__
    assert record["timestamp"] and record["command"]


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


def test_print_table(capsys):
    rows = [{"layer": "dense", "count": 61, "value": 0.123456}, {"layer": "moe K=16", "count": 0}]
    table = print_table(rows, floatfmt=".3f")
    assert capsys.readouterr().out == table + "\n"
    lines = table.splitlines()
    assert lines[0] == "| layer    | count | value |"
    assert lines[1] == "|:---------|------:|------:|"
    assert lines[2] == "| dense    |    61 | 0.123 |"
    assert lines[3] == "| moe K=16 |     0 |       |"
    assert len({len(line) for line in lines}) == 1
    only = print_table(rows, columns=["count"])
    assert only.splitlines()[0] == "| count |"


def test_progress_yields_everything():
    assert list(progress(range(5), desc="test")) == [0, 1, 2, 3, 4]
