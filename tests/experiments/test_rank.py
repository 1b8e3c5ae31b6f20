"""experiments/rank.py: the random-head smoke preset, model mode and CLI errors, in this process."""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bottleneck import spectrum_streaming as ss
from tests.script_runs import run_main
from tests.usage import plain

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "rank.py"
SMOKE_DIMS = (4, 8)


@pytest.fixture(scope="module")
def rank_script():
    """The script as a module, to call ``main(argv)`` in-process (no JAX start-up per call)."""
    spec = importlib.util.spec_from_file_location("rank_experiment", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses resolve the Config's string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def smoke(rank_script, tmp_path_factory):
    """The smoke preset's folder and stdout."""
    out_dir = tmp_path_factory.mktemp("rank_smoke")
    code, stdout, stderr = run_main(rank_script.main, "smoke", "--out_dir", str(out_dir))
    assert code == 0, stderr
    return out_dir, stdout


def test_random_smoke_writes_files(smoke):
    out_dir, stdout = smoke
    for name in ["config.json", "results.json", "results.csv", "metrics.jsonl"]:
        assert (out_dir / name).stat().st_size > 0, name
    for name in ["rank_vs_d.png", f"spectra_d{max(SMOKE_DIMS)}.png"]:
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "| head" in stdout and "numerical_rank" in stdout
    with (out_dir / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 8 * len(SMOKE_DIMS)


def test_random_softmax_sits_at_d_plus_2_and_the_others_above(smoke):
    runs = json.loads((smoke[0] / "results.json").read_text())["runs"]
    assert sorted({r["d"] for r in runs}) == list(SMOKE_DIMS)
    assert len({r["head"] for r in runs}) == 8
    for run in runs:
        if run["head"] == "softmax":
            assert run["numerical_rank"] == run["d"] + 2, run
            assert run["tail_over_tol"] < 1  # round-off does not come near the threshold
        else:
            assert run["numerical_rank"] > run["d"] + 2, run
        values = np.asarray(run["singular_values"])
        assert values.shape == (run["max_rank"],) and np.all(np.diff(values) <= 0)


def rank_matrix(rows: int, cols: int, rank: int, seed: int = 0) -> np.ndarray:
    """float32 ``[rows, cols]`` of rank ``rank``, offset like log-probs (the offset adds none)."""
    rng = np.random.default_rng(seed)
    factors = rng.standard_normal((rows, rank - 1)) @ rng.standard_normal((rank - 1, cols))
    return (factors - 7.0).astype(np.float32)


def run_model(rank_script, out_dir: Path, path: Path, *flags: str) -> dict:
    argv = ["--mode", "model", "--log_probs", str(path), "--out_dir", str(out_dir), *flags]
    rank_script.main(argv)
    return json.loads((out_dir / "results.json").read_text())


def test_model_mode_file_and_blocks_match_a_full_svd(rank_script, tmp_path, capsys):
    a = rank_matrix(240, 90, rank=13)
    np.save(tmp_path / "a.npy", a)
    blocks = tmp_path / "blocks"
    blocks.mkdir()
    for i, part in enumerate(np.split(a, [100, 101, 170])):
        np.save(blocks / f"part{i:02d}.npy", part)
    expected = np.linalg.svd(a.astype(np.float64), compute_uv=False)

    for path, flags in [(tmp_path / "a.npy", ()), (blocks, ("--block_rows", "32"))]:
        out_dir = tmp_path / f"out_{path.name}"
        results = run_model(rank_script, out_dir, path, "--hidden_size", "11", *flags)
        assert results["numerical_rank"] == 13 == results["d+2"]
        assert (results["rows_analysed"], results["columns_analysed"]) == (240, 90)
        assert not results["columns_subsampled"] and not results["rank_is_lower_bound"]
        values = np.asarray(results["singular_values"])
        np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6 * expected[0])
        with (out_dir / "spectrum.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 90 and rows[0]["index"] == "1"
        assert (out_dir / "spectrum.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "numerical_rank" in capsys.readouterr().out


def test_model_mode_subsamples_columns_reproducibly(rank_script, tmp_path, capsys):
    a = rank_matrix(120, 200, rank=30, seed=1)  # T < M: min(T, M) values come back
    np.save(tmp_path / "a.npy", a)
    flags = ("--max_vocab", "60", "--max_json_values", "25", "--seed", "3")
    first = run_model(rank_script, tmp_path / "one", tmp_path / "a.npy", *flags)
    second = run_model(rank_script, tmp_path / "two", tmp_path / "a.npy", *flags)
    assert first["columns_subsampled"] and first["rank_is_lower_bound"]
    assert "vocabulary subsampled: 60 of 200" in capsys.readouterr().out
    assert first["singular_values"] == second["singular_values"]
    assert first["num_singular_values"] == 60 and len(first["singular_values"]) == 25
    assert first["singular_values_truncated"] and first["numerical_rank"] == 30
    columns = ss.sample_indices(200, 60, seed=3)
    expected = np.linalg.svd(a[:, columns].astype(np.float64), compute_uv=False)
    np.testing.assert_allclose(first["singular_values"], expected[:25], atol=1e-6 * expected[0])
    other = run_model(rank_script, tmp_path / "three", tmp_path / "a.npy", "--max_vocab", "60")
    assert other["singular_values"] != first["singular_values"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "softmax", "nope"], "invalid choice 'nope' for argument '--heads'"),
        (["--dims", "8", "0"], "dims must be >= 1, got (8, 0)"),
        (["--mode", "model"], "--log_probs PATH is required in model mode"),
        (["--mode", "model", "--log_probs", "/nonexistent/lp.npy"], "does not exist"),
        (["--mode", "sideways"], "invalid choice 'sideways' for argument"),
        (["--heads", "mos", "--num_components", "1"], "num_components must be >= 2"),
        (["--heads", "plif", "--num_knots", "1"], "num_knots must be >= 2"),
    ],
)
def test_bad_cli_values_exit_with_a_message(rank_script, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        rank_script.main([*argv, "--out_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    text = plain(capsys.readouterr().err)
    assert message in text, text
    assert not (tmp_path / "out").exists()  # nothing is written before the config is valid
