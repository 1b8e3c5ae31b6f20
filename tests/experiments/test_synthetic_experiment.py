import dataclasses
import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments import synthetic
from tests.paths import ROOT
from tests.script_runs import run_main
from tests.usage import plain

SCRIPT = ROOT / "experiments" / "synthetic.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT
    )


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """The smoke preset twice: as a command (the page's tests read its output), then in this
    process (tests/script_runs.py), so that equal results are equal across two processes."""
    out = [tmp_path_factory.mktemp(f"synthetic{i}") for i in range(2)]
    result = _run("smoke", "--out_dir", str(out[0]))
    assert result.returncode == 0, result.stderr
    code, _, stderr = run_main(synthetic.main, "smoke", "--out_dir", str(out[1]))
    assert code == 0, stderr
    return out, [result]


def test_smoke_preset_writes_results_table_and_plot(smoke_runs):
    (out, _), (result,) = smoke_runs
    for name in (
        "results.json",
        "results.md",
        "results.csv",
        "metrics.jsonl",
        "config.json",
        "synthetic_alpha0.01.png",
    ):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert sorted((r["head"], r["d"], r["seed"]) for r in runs) == sorted(
        (h, d, s) for h in ("softmax", "plif", "mos") for d in (2, 4) for s in (0, 1)
    )
    for r in runs:
        assert 0 <= r["mode_matching"] <= 100 and r["kl"] >= 0
        if r["head"] == "softmax":  # rank <= d + 2 with the output bias (Theorem 2)
            assert r["numerical_rank"] <= r["d"] + 2
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["steps"] == 40 and config["seed"] is None
    assert "alpha |" in result.stdout and "mode_matching" in result.stdout
    page = (out / "results.md").read_text()
    assert page.startswith("# Synthetic Dirichlet study") and "at commit `" in page
    assert page.count("alpha |") == 2  # mean ± std, then every seed
    for row in results["summary"]:  # the summary is the seeds' mean and std, on the page
        seeds = [r for r in runs if (r["head"], r["d"]) == (row["head"], row["d"])]
        kl = np.array([r["kl"] for r in seeds])
        assert row["seeds"] == 2
        np.testing.assert_allclose([row["kl"], row["kl_std"]], [kl.mean(), kl.std(ddof=1)])
        text = f"| {row['head']:<7} |       2 | {synthetic.mean_std_text(row, 'mode_matching')} "
        assert text in page, text


def test_summary_is_mean_and_std_over_seeds():
    """Worked by hand: KL 1.0, 2.0, 4.0 over three seeds: mean 7/3, std sqrt(7/3) (ddof = 1)."""
    rows = [
        {
            "alpha": 0.01,
            "d": 4,
            "head": "softmax",
            "seed": seed,
            **dict.fromkeys(synthetic.METRICS, v),
        }
        for seed, v in ((0, 1.0), (1, 2.0), (2, 4.0))
    ] + [
        {
            "alpha": 0.01,
            "d": 8,
            "head": "softmax",
            "seed": 0,
            **dict.fromkeys(synthetic.METRICS, 5.0),
        }
    ]
    four, eight = synthetic.summarize(rows)
    assert (four["d"], four["seeds"], eight["seeds"]) == (4, 3, 1)
    assert four["kl"] == pytest.approx(7 / 3) and four["kl_std"] == pytest.approx((7 / 3) ** 0.5)
    assert eight["kl"] == 5.0 and eight["kl_std"] is None
    assert synthetic.mean_std_text(four, "kl") == "2.333 ± 1.528"
    assert synthetic.mean_std_text(eight, "mode_matching") == "5.0"


def test_seeds_must_be_distinct():
    with pytest.raises(ValueError, match="seeds must be distinct"):
        synthetic.Config(seeds=(1, 1))


def test_same_seed_same_results(smoke_runs):
    outs, _ = smoke_runs
    first, second = (json.loads((o / "results.json").read_text())["runs"] for o in outs)
    strip = lambda runs: [{k: v for k, v in r.items() if k != "seconds"} for r in runs]  # noqa: E731
    assert strip(first) == strip(second)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heads", "softmax", "nope"], "invalid choice 'nope' for argument '--heads'"),
        (["--dims", "0", "4"], "dims must be >= 1, got (0, 4)"),
        (["--alphas", "-0.1"], "alphas must be > 0, got (-0.1,)"),
        (["huge"], "Unrecognized options: huge"),
        (["--learning_rate", "nan"], "learning_rate must be finite, got nan"),
        (["--alphas", "0.1", "inf"], "alphas must be finite"),
        (["--mesh", "data=3"], "needs data x vocab = 3 devices but 1 are available"),
        (["--mesh", "vocab=8"], "xla_force_host_platform_device_count"),
        # A head's own options, checked with the config (before any folder is written).
        (
            ["--heads", "softmax", "mos", "--num_components", "1"],
            "num_components must be >= 2 for the mixture preset 'mos'",
        ),
        (["--heads", "plif", "--num_knots", "1"], "num_knots must be >= 2 (one knot makes"),
        (["--heads", "plif", "--plif_noise", "-1"], "plif_noise must be a finite number >= 0"),
    ],
)
def test_bad_cli_values_exit_with_message(args, message, tmp_path, capsys):
    # In-process: each case fails before any computation, so a subprocess would cost only
    # JAX's start-up. The refused run leaves no config behind.
    with pytest.raises(SystemExit) as exit_info:
        synthetic.main([*args, "--out_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    text = plain(capsys.readouterr().err)
    assert message in text, text
    assert not (tmp_path / "run").exists()  # no config.json, checkpoints/ or tfds/


def test_another_experiments_folder_and_a_file_are_refused_in_one_line(tmp_path):
    run = tmp_path / "lm"
    run.mkdir()
    config = json.dumps({"experiment": "language_model", "config": {}})
    (run / "config.json").write_text(config)
    code, _, stderr = run_main(synthetic.main, "smoke", "--out_dir", str(run))
    assert code == 2
    assert "holds a run of language_model, not of synthetic" in stderr
    assert (run / "config.json").read_text() == config  # untouched
    (tmp_path / "file").write_text("x")
    code, _, stderr = run_main(synthetic.main, "smoke", "--out_dir", str(tmp_path / "file"))
    assert code == 2 and "exists and is not a folder" in stderr


def test_ctrl_c_keeps_the_finished_runs_and_a_rerun_goes_on_from_them(tmp_path):
    """SIGINT during the second of two runs: exit 130 without a traceback, the first run kept
    with a page titled partial and its plot; the same command then trains only the second, and
    the kept row is unchanged. Another setting than the kept rows' is refused in one line."""
    out = tmp_path / "run"
    args = [sys.executable, str(SCRIPT), "smoke", "--steps", "10000",
            "--log_every", "10", "--heads", "softmax", "--dims", "2", "--seeds", "0", "1",
            "--out_dir", str(out)]  # fmt: skip
    process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    results = out / "results.json"
    while not results.is_file() or not json.loads(results.read_text() or "{}").get("runs"):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    stderr = stderr.decode()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "stopped: 1 runs kept" in stderr
    kept = json.loads(results.read_text())["runs"]
    assert [r["seed"] for r in kept] == [0]
    title = (out / "results.md").read_text().splitlines()[0]
    assert title.endswith("partial (1 of the grid's 2 runs to go)")
    assert (out / "synthetic_alpha0.01.png").stat().st_size > 0
    code, stdout, stderr = run_main(synthetic.main, *args[2:])  # the rerun: in this process
    assert code == 0, stderr
    assert f"resuming {out}: 1 runs recorded, 1 to go" in stdout
    runs = json.loads(results.read_text())["runs"]
    assert [r["seed"] for r in runs] == [0, 1] and runs[0] == kept[0]
    assert "partial" not in (out / "results.md").read_text().splitlines()[0]
    before = results.read_text()
    code, _, stderr = run_main(synthetic.main, *args[2:], "--num_outcomes", "65")
    assert code == 2 and "num_outcomes: 64 -> 65" in stderr
    assert results.read_text() == before


def test_every_flag_has_help(capsys, monkeypatch):
    """--help explains each flag beyond its type and default (it once listed bare names)."""
    monkeypatch.setenv("COLUMNS", "200")  # one line per flag
    with pytest.raises(SystemExit):
        synthetic.main(["--help"])
    lines = [
        line.strip("│ ")
        for line in capsys.readouterr().out.split("(source subcommand: default)")[1].splitlines()
    ]
    entries, entry = [], []  # one per flag: its line and the help's continuation lines
    for line in lines:
        if line.startswith("--") and entry:
            entries.append(" ".join(entry))
            entry = []
        entry.append(line)
    entries.append(" ".join(entry))
    for field in dataclasses.fields(synthetic.Config):
        (text,) = [e for e in entries if e.startswith(f"--{field.name} ")]
        bare = re.sub(r"\(default: [^)]*\)?|\{[^}]*\}|\[[^]]*\]|\b[A-Z]+\b|[╰─╯-]", "", text)
        assert re.search(r"[a-z]{3}", bare.split(" ", 1)[1]), text
