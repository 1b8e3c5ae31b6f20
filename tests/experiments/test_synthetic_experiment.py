import json
import pathlib
import subprocess
import sys

import pytest

from experiments import synthetic

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "synthetic.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT
    )


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    out = [tmp_path_factory.mktemp(f"synthetic{i}") for i in range(2)]
    results = [_run("--preset", "smoke", "--out_dir", str(o)) for o in out]
    for result in results:
        assert result.returncode == 0, result.stderr
    return out, results


def test_smoke_preset_writes_results_table_and_plot(smoke_runs):
    (out, _), (result, _) = smoke_runs[0], smoke_runs[1]
    for name in (
        "results.json",
        "results.md",
        "results.csv",
        "metrics.jsonl",
        "config.json",
        "synthetic_alpha0.01.png",
    ):
        assert (out / name).stat().st_size > 0, name
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert {(r["head"], r["d"]) for r in runs} == {
        (h, d) for h in ("softmax", "plif", "mos") for d in (2, 4)
    }
    for r in runs:
        assert 0 <= r["mode_matching"] <= 100 and r["kl"] >= 0
        if r["head"] == "softmax":  # rank <= d + 2 with the output bias (Theorem 2)
            assert r["numerical_rank"] <= r["d"] + 2
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["steps"] == 40 and config["seed"] is None
    assert "alpha |" in result.stdout and "mode_matching" in result.stdout
    page = (out / "results.md").read_text()
    assert page.startswith("# Synthetic Dirichlet study") and "at commit `" in page
    assert page.count("alpha |") == 1


def test_same_seed_same_results(smoke_runs):
    outs, _ = smoke_runs
    first, second = (json.loads((o / "results.json").read_text())["runs"] for o in outs)
    strip = lambda runs: [{k: v for k, v in r.items() if k != "seconds"} for r in runs]  # noqa: E731
    assert strip(first) == strip(second)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heads", "softmax", "nope"], "argument --heads: "),
        (["--dims", "0", "4"], "dims must be >= 1, got (0, 4)"),
        (["--alphas", "-0.1"], "alphas must be > 0, got (-0.1,)"),
        (["--preset", "huge"], "argument --preset: invalid choice 'huge'"),
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
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("synthetic.py: error: ") and message in line
    assert not (tmp_path / "run").exists()  # no config.json, checkpoints/ or tfds/


def test_another_experiments_folder_and_a_file_are_refused_in_one_line(tmp_path):
    run = tmp_path / "lm"
    run.mkdir()
    config = json.dumps({"experiment": "language_model", "config": {}})
    (run / "config.json").write_text(config)
    result = _run("--preset", "smoke", "--out_dir", str(run))
    assert result.returncode == 2
    assert "holds a run of language_model, not of synthetic" in result.stderr
    assert "Traceback" not in result.stderr
    assert (run / "config.json").read_text() == config  # untouched
    (tmp_path / "file").write_text("x")
    result = _run("--preset", "smoke", "--out_dir", str(tmp_path / "file"))
    assert result.returncode == 2 and "exists and is not a folder" in result.stderr
    assert "Traceback" not in result.stderr
