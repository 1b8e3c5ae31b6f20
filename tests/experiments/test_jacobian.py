"""experiments/jacobian.py end to end: the smoke preset (in this process, and again as a command
for its reproducibility), its files and its CLI errors."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import jacobian
from tests.script_runs import run_main
from tests.usage import plain

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "jacobian.py"

SMOKE_WIDTH, SMOKE_EXPERTS = 16, (2, 4)


def run_script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=SCRIPT.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke preset's folder and stdout."""
    out_dir = tmp_path_factory.mktemp("jacobian_smoke")
    code, stdout, stderr = run_main(jacobian.main, "smoke", "--out_dir", str(out_dir))
    assert code == 0, stderr
    return out_dir, stdout


def load_results(out_dir: Path) -> dict:
    return json.loads((out_dir / "results.json").read_text())


def test_writes_all_files(smoke):
    out_dir, stdout = smoke
    for name in ["config.json", "results.json", "results.csv", "metrics.jsonl"]:
        assert (out_dir / name).stat().st_size > 0, name
    assert (out_dir / "singular_values.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out_dir / "config.json").read_text())
    assert config["config"]["width"] == SMOKE_WIDTH and config["seed"] == 0
    assert "| layer" in stdout and "near_zero_count" in stdout
    assert str(out_dir) in stdout


def test_spectra_are_sorted_mean_singular_values(smoke):
    results = load_results(smoke[0])
    layers = results["layers"]
    # Dense, then gated MoE for each K, then constant-gate MoE for each K.
    assert [(layer["K"], layer["gates"]) for layer in layers] == [
        (1, "none"),
        *[(k, "softmax") for k in SMOKE_EXPERTS],
        *[(k, "constant") for k in SMOKE_EXPERTS],
    ]
    for layer in layers:
        values = np.asarray(layer["singular_values"])
        assert values.shape == (SMOKE_WIDTH,)
        assert np.all(np.isfinite(values)) and np.all(values >= 0)
        assert np.all(np.diff(values) <= 1e-6 * values[0]), layer["name"]


def test_near_zero_counts(smoke):
    results = load_results(smoke[0])
    layers = results["layers"]
    dense = layers[0]
    threshold = results["near_zero_threshold"]
    np.testing.assert_allclose(threshold, 1e-3 * dense["singular_values"][0], rtol=1e-12)
    assert "dense layer's largest" in results["near_zero_definition"]
    for layer in layers:
        assert layer["near_zero_count"] == sum(v < threshold for v in layer["singular_values"])

    # A unit that is off at an input zeroes a row of the dense Jacobian; about half are off,
    # so a good share of the mean spectrum is ~0 (Orhan: about half; fewer here because the
    # mean over inputs is only ~0 beyond the largest number of active units among the inputs).
    assert dense["near_zero_count"] >= SMOKE_WIDTH // 8
    # A row of the MoE Jacobian is zero only if that unit is off in all K experts
    # (probability 2^-K), so more experts leave fewer ~0 singular values, with either gates.
    for gates in ("softmax", "constant"):
        counts = [layer["near_zero_count"] for layer in layers if layer["gates"] == gates]
        assert all(count < dense["near_zero_count"] for count in counts), (gates, counts)
        assert counts == sorted(counts, reverse=True), (gates, counts)


def test_csv_has_one_row_per_layer(smoke):
    results = load_results(smoke[0])
    with (smoke[0] / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "layer",
        "K",
        "gates",
        "near_zero_count",
        "largest",
        "median",
        "smallest",
    ]
    assert len(rows) == len(results["layers"])
    for row, layer in zip(rows, results["layers"], strict=True):
        assert row["layer"] == layer["name"]
        assert int(row["near_zero_count"]) == layer["near_zero_count"]
        assert float(row["largest"]) == layer["singular_values"][0]
        assert float(row["smallest"]) == layer["singular_values"][-1]


def test_reproducible_for_a_fixed_seed(env, smoke, tmp_path):
    result = run_script(env, "smoke", "--out_dir", str(tmp_path))  # another process
    assert result.returncode == 0, result.stderr
    assert load_results(tmp_path) == load_results(smoke[0])


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "Unrecognized options: nope"),
        (["--width", "0"], "width must be >= 1, got 0"),
        (["--experts", "2", "0"], "experts must be >= 1, got (2, 0)"),
        (["--experts", "2", "2"], "experts must be distinct, got 2 2"),
        (["--num_inputs", "many"], "--num_inputs: invalid literal for int()"),
    ],
)
def test_bad_cli_values_exit_with_a_clear_message(args, message, tmp_path, capsys):
    out_dir = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:  # in-process: it fails before computing
        jacobian.main([*args, "--out_dir", str(out_dir)])
    assert exit_info.value.code == 2
    text = plain(capsys.readouterr().err)
    assert message in text, text
    assert not out_dir.exists()
