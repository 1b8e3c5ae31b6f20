"""Checked configs, parse_config (tyro) with presets as subcommands, usage errors, markdown_table, progress."""

import dataclasses
import json
import logging
import re
import signal
from typing import Annotated, ClassVar, Literal, Union

import numpy as np
import pytest
import tyro

from bottleneck.runs import (
    Checked,
    TrainingInterrupted,
    UsageError,
    markdown_table,
    parse_config,
    progress,
)
from bottleneck.runs.cli import Count, Interval, Positive, one_line_errors, show_logs


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """A config with one field of every supported kind."""

    width: Count = 8  # the width
    lr: Positive = 0.1
    name: str = "run"
    plot: bool = True
    experts: tuple[Count, ...] = (2, 4)
    scales: tuple[float, ...] = (1.0,)
    pair: tuple[int, float] = (1, 2.0)
    limit: int | None = None
    mode: Literal["fast", "slow"] = "fast"
    seed: int = 0
    out_dir: str = "runs/test"


PRESETS = {"smoke": Config(width=2, experts=(1,)), "big": Config(width=64, lr=0.5)}


def test_defaults_without_flags():
    assert parse_config(Config, PRESETS, []) == Config()


def test_preset_then_flags_override():
    config = parse_config(Config, PRESETS, ["smoke", "--lr", "0.25"])
    assert config == Config(width=2, experts=(1,), lr=0.25, out_dir="runs/test_smoke")
    config = parse_config(Config, PRESETS, ["big", "--width", "3"])
    assert config == Config(width=3, lr=0.5, out_dir="runs/test_big")


def test_every_field_type_parses():
    argv = [
        "--width=5", "--lr", "1e-3", "--name", "a b", "--no_plot", "--experts", "2", "4", "8",
        "--scales", "0.5", "2", "--pair", "3", "4.5", "--limit", "7", "--mode", "slow",
        "--out_dir", "/tmp/somewhere",
    ]  # fmt: skip
    assert parse_config(Config, PRESETS, argv) == Config(
        width=5, lr=1e-3, name="a b", plot=False, experts=(2, 4, 8), scales=(0.5, 2.0),
        pair=(3, 4.5), limit=7, mode="slow", out_dir="/tmp/somewhere",
    )  # fmt: skip
    assert parse_config(Config, PRESETS, ["--limit", "None"]).limit is None
    assert parse_config(Config, PRESETS, ["--experts"]).experts == ()
    assert parse_config(Config, PRESETS, ["--no-plot"]).plot is False  # either spelling
    assert parse_config(Config, PRESETS, ["big", "--plot"]).plot is True


def test_default_preset_can_be_redefined():
    assert parse_config(Config, {"default": Config(width=4)}, []).width == 4


def _usage_error(capsys, config_cls, presets, argv) -> str:
    """parse_config's stderr for ``argv``, which must be refused with status 2: our own line
    (``test_cli.py: error: ...``) or tyro's box, its frame removed and its lines joined."""
    with pytest.raises(SystemExit) as exit_info:
        parse_config(config_cls, presets, argv)
    assert exit_info.value.code == 2
    return _plain(capsys.readouterr().err).removeprefix("test_cli.py: error: ")


def _plain(text: str) -> str:
    """tyro's boxed text without its frame (box-drawing or ASCII), its lines joined."""
    text = re.sub(r"[\u2500-\u257f]|-{3,}|^\s*[|+]|[|+]\s*$", " ", text, flags=re.MULTILINE)
    return " ".join(text.split())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nope"], "Unrecognized options: nope Available subcommands: default, smoke, big"),
        (["--width", "abc"], "--width: invalid literal for int() with base 10: 'abc'"),
        (["--experts", "2", "x"], "--experts: Could not find valid parse for arguments"),
        (["--pair", "1", "2", "3"], "Unrecognized options: 3"),
        (["--unknown", "1"], "Unrecognized options: --unknown, 1"),
        (["--mode", "medium"], "invalid choice 'medium' for argument '--mode'"),
        (["--width", "0"], "width must be >= 1, got 0"),
        (["--experts", "2", "0"], "experts must be >= 1, got (2, 0)"),
        (["--lr", "0"], "lr must be > 0, got 0.0"),
        (["--lr", "nan"], "lr must be finite, got nan"),
        (["--lr", "inf"], "lr must be finite, got inf"),
        (["--lr=-inf"], "lr must be finite, got -inf"),
        (["--scales", "1.0", "nan"], "scales must be finite, got (1.0, nan)"),
        (["--pair", "1", "nan"], "pair must be finite, got (1, nan)"),
    ],
)
def test_bad_flags_end_with_status_2_and_say_why(argv, message, capsys):
    assert message in _usage_error(capsys, Config, PRESETS, argv)


def test_a_named_preset_gets_its_own_default_out_dir():
    # A preset that keeps the default folder gets "<default>_<name>" (so a smoke run never
    # replaces the default run's results); --out_dir and a preset's own folder win.
    assert parse_config(Config, PRESETS, ["smoke"]).out_dir == "runs/test_smoke"
    assert parse_config(Config, PRESETS, []).out_dir == "runs/test"
    argv = ["smoke", "--out_dir", "elsewhere"]
    assert parse_config(Config, PRESETS, argv).out_dir == "elsewhere"
    presets = {"x-y": Config(out_dir="mine"), "z-w": Config()}
    assert parse_config(Config, presets, ["x-y"]).out_dir == "mine"
    assert parse_config(Config, presets, ["z-w"]).out_dir == "runs/test_z_w"


def test_configs_check_themselves_when_built_or_replaced():
    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        Config(width=0)
    with pytest.raises(ValueError, match=r"lr must be finite, got nan"):
        dataclasses.replace(Config(), lr=float("nan"))
    with pytest.raises(ValueError, match="mode must be one of fast, slow, got 'medium'"):
        dataclasses.replace(Config(), mode="medium")
    with pytest.raises(ValueError, match=r"must be >= 1 or None, got 0"):
        Optimizer(patience=0)
    with pytest.raises(ValueError, match="width must be >= seed"):
        dataclasses.replace(Nested(), seed=9)  # the config's own check, after its fields'
    assert 0.5 in Interval("(0, 1]") and 0 not in Interval("(0, 1]") and 1 in Interval("(0, 1]")


@dataclasses.dataclass(frozen=True)
class Optimizer(Checked):
    """How to step."""

    lr: Positive = 0.1
    name: Annotated[Literal["sgd", "adam"], tyro.conf.arg(aliases=("--optimizer",))] = "sgd"
    patience: Count | None = None


@dataclasses.dataclass(frozen=True)
class Small(Checked):
    """A small model."""

    family: ClassVar[str] = "small"
    width: Count = 8
    lr: float = 1.0  # a second "lr": both answer to their dotted names only


@dataclasses.dataclass(frozen=True)
class Large(Checked):
    """A large model."""

    family: ClassVar[str] = "large"
    depth: Count = 12


Model = Union[  # noqa: UP007
    Annotated[Small, tyro.conf.subcommand("small")], Annotated[Large, tyro.conf.subcommand("large")]
]


@dataclasses.dataclass(frozen=True)
class Nested(Checked):
    """A config with parts, one of them chosen from a union."""

    optimizer: Optimizer = Optimizer()
    model: Model = Small()
    seed: int = 0
    out_dir: str = "runs/nested"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.model, Small) and self.model.width < self.seed:
            raise ValueError("width must be >= seed")


NESTED_PRESETS = {
    "wide": Nested(Optimizer(name="adam"), Small(width=64)),
    "large": Nested(model=Large(depth=3), seed=2),
}


def test_parts_are_groups_of_dotted_flags_with_unique_short_names():
    config = parse_config(Nested, NESTED_PRESETS, ["wide", "--optimizer.lr", "0.5"])
    assert config == Nested(Optimizer(0.5, "adam"), Small(width=64), out_dir="runs/nested_wide")
    # A field's own name (or its alias) works where no other field claims it.
    assert parse_config(Nested, {}, ["--width", "3", "--optimizer", "adam"]) == parse_config(
        Nested, {}, ["--model.width", "3", "--optimizer.name", "adam"]
    )
    assert parse_config(Nested, {}, ["--model.lr", "2"]).model.lr == 2.0


def test_a_union_is_a_choice_whose_fields_exist_only_when_chosen(capsys):
    assert parse_config(Nested, None, ["model:large"]).model == Large()
    config = parse_config(Nested, None, ["model:large", "--depth", "4", "--seed", "1"])
    assert config == Nested(model=Large(depth=4), seed=1)
    # A preset chooses the member; its fields are then flags without naming it.
    config = parse_config(Nested, NESTED_PRESETS, ["large", "--model.depth", "5"])
    assert config.model == Large(depth=5) and config.seed == 2
    assert parse_config(Nested, NESTED_PRESETS, ["large", "model:small"]).model == (Small())
    message = _usage_error(capsys, Nested, NESTED_PRESETS, ["--depth", "4"])
    assert "Unrecognized or misplaced options: --depth" in message  # the default model is small
    message = _usage_error(capsys, Nested, NESTED_PRESETS, ["--seed", "9"])
    assert "width must be >= seed" in message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "1"], "Unrecognized options: --lr, 1"),  # two fields are called lr
        (["--optimizer.lr", "nan"], "lr must be finite, got nan"),
        (["--optimizer.lr", "0"], "lr must be > 0, got 0.0"),
        (["--optimizer", "rmsprop"], "invalid choice 'rmsprop' for argument"),
        (["--patience", "0"], "patience must be >= 1 or None, got 0"),
        (["--width", "0"], "width must be >= 1, got 0"),
        (["model:medium"], "Unrecognized options: model:medium"),
    ],
)
def test_nested_values_are_checked(argv, message, capsys):
    assert message in _usage_error(capsys, Nested, NESTED_PRESETS, argv)


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--patiense", "2"], "--patience"),  # a typo; unique: its own name
        (["--optimiser.lr", "1"], "--optimizer.lr"),
    ],
)
def test_an_unknown_flag_names_the_flags_it_may_mean(argv, hint, capsys):
    message = _usage_error(capsys, Nested, NESTED_PRESETS, argv)
    assert f"Unrecognized options: {', '.join(argv)}" in message
    assert "Perhaps you meant:" in message and hint in message.split("Perhaps you meant:")[1]
    assert "Perhaps" not in _usage_error(capsys, Nested, NESTED_PRESETS, ["--bogus", "1"])


def test_help_shows_the_groups_both_spellings_and_what_each_preset_sets(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Nested, NESTED_PRESETS, ["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "A config with parts" in text and "optimizer options" in text and "How to step." in text
    assert "--width INT, --model.width INT" in text and "--model.lr FLOAT" in text
    assert "--optimizer {sgd,adam}, --optimizer.name {sgd,adam}" in text
    assert "model:small" in text and "model:large" in text
    presets = _plain(text[text.index("subcommands") :])
    assert presets.startswith("subcommands (default: default)")
    for preset in (
        "default the defaults",
        "wide --optimizer adam --width 64 --out_dir runs/nested_wide",
        "large model:large --depth 3 --seed 2 --out_dir runs/nested_large",
    ):
        assert preset in presets


@dataclasses.dataclass(frozen=True)
class Required(Checked):
    """A field without a default is required."""

    run_dir: str
    tokens: Count = 4


def test_a_field_without_a_default_is_required(capsys):
    assert parse_config(Required, argv=["--run_dir", "x"]) == Required("x")
    message = _usage_error(capsys, Required, None, ["--tokens", "2"])
    assert "Required options" in message and "--run_dir STR" in message
    assert "Unrecognized options: smoke" in _usage_error(
        capsys, Required, None, ["smoke", "--run_dir", "x"]
    )  # no presets, no preset subcommands


def test_a_folder_of_another_experiment_or_a_file_is_refused_when_parsed(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"experiment": "language_model"}))
    message = _usage_error(capsys, Config, PRESETS, ["--out_dir", str(other)])
    assert "holds a run of language_model, not of test_cli" in message
    path = tmp_path / "file"
    path.write_text("x")
    for out_dir, expected in ((path, "exists and is not a folder"), (path / "x", "cannot be")):
        assert expected in _usage_error(capsys, Config, PRESETS, ["--out_dir", str(out_dir)])


class Diverged(RuntimeError):
    pass


def test_one_line_errors_end_the_script_with_the_status_given(capsys):
    with pytest.raises(SystemExit) as exit_info, one_line_errors(Config()):
        raise UsageError("no such corpus\n  (looked in x)")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "test_cli.py: error: no such corpus (looked in x)\n"
    with pytest.raises(SystemExit) as exit_info, one_line_errors(Config, {Diverged: 1}):
        raise Diverged("the loss became nan")
    assert exit_info.value.code == 1
    with pytest.raises(KeyError), one_line_errors(Config):
        raise KeyError("a bug is a traceback")


def test_an_interrupted_run_ends_quietly_with_its_signals_status(capsys):
    with pytest.raises(SystemExit) as exit_info, one_line_errors(Config()):
        raise TrainingInterrupted(128 + signal.SIGTERM)
    assert exit_info.value.code == 143 and capsys.readouterr().err == ""
    assert "rerun the same command" in str(TrainingInterrupted(130))
    # Ctrl-C where nothing was saving (sampling, BAT's program): one line, status 130.
    with pytest.raises(SystemExit) as exit_info, one_line_errors(Config()):
        raise KeyboardInterrupt
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == "test_cli.py: interrupted\n"


def test_show_logs_puts_the_librarys_lines_on_stderr_once(capsys):
    show_logs()
    show_logs()  # idempotent: one handler
    logging.getLogger("bottleneck.runs.run_loop").info("resumed x at epoch 2, window 0")
    assert capsys.readouterr().err == "resumed x at epoch 2, window 0\n"


def test_markdown_table():
    rows = [
        {"layer": "dense", "count": 61, "value": 0.123456, "code": "007"},
        {"layer": "moe K=16", "count": np.int64(0), "value": float("nan"), "code": True},
        {"layer": "tiny", "count": 2},
    ]
    lines = markdown_table(rows, floatfmt=".3f").splitlines()
    assert [cell.strip() for cell in lines[0].strip("|").split("|")] == [
        "layer", "count", "value", "code"
    ]  # fmt: skip
    # Numbers right-aligned, text (a string or a bool in the column) left-aligned.
    assert [cell[0] + cell[-1] for cell in lines[1].strip("|").split("|")] == [
        ":-", "-:", "-:", ":-"
    ]  # fmt: skip
    assert [cell.strip() for cell in lines[2].strip("|").split("|")] == [
        "dense",
        "61",
        "0.123",
        "007",
    ]
    assert [cell.strip() for cell in lines[3].strip("|").split("|")] == [
        "moe K=16",
        "0",
        "nan",
        "True",
    ]
    assert [cell.strip() for cell in lines[4].strip("|").split("|")] == ["tiny", "2", "", ""]
    assert lines[2].index("61") + 2 == lines[3].index("0 ") + 1  # right-aligned: same last column
    assert len({len(line) for line in lines}) == 1
    with_none = markdown_table([{"std": None}, {"std": 0.123456}], floatfmt=".2f").splitlines()
    assert [line.strip("| ") for line in with_none[2:]] == ["", "0.12"]  # still a number column
    only = markdown_table(rows, columns=["count"])
    assert only.splitlines()[0].strip("| ") == "count"
    assert markdown_table([{"layer": "dense", "count": 1}], ["layer"]).count("\n") == 2


def test_progress_yields_everything():
    assert list(progress(range(5), desc="test")) == [0, 1, 2, 3, 4]
