"""experiments/lm_study.py: the smoke grid end to end, resuming cells, a failing cell.

Subprocesses share one persistent JAX compilation cache (and XLA's fast compile mode), so the
cells after the first compile little.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "lm_study.py"
sys.path.insert(0, str(SCRIPT.parent))
import lm_study  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "XLA_FLAGS": "--xla_backend_optimization_level=0",
        "JAX_PLATFORMS": "cpu",
    }


def _run(env, *args):
    process = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "smoke", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return process.returncode, process.stdout, process.stderr


def _cells(out):
    return {
        (c["head"], c["d"], c["seed"]): c
        for c in json.loads((out / "study.json").read_text())["cells"]
    }


@pytest.fixture(scope="module")
def smoke(env, tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    code, stdout, stderr = _run(env, "--out_dir", str(out))
    assert code == 0, stderr
    return out, stdout


def test_smoke_grid_writes_every_output(smoke):
    out, stdout = smoke
    for name in ("config.json", "study.json", "study.csv", "study.md"):
        assert (out / name).stat().st_size > 0, name
    for name in ("test_ppl_vs_d.png", "learning_curves.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    cells = _cells(out)
    assert sorted(cells) == [("mos", 4, 1), ("softmax", 4, 1)]
    for (head, d, _), cell in cells.items():
        assert cell["status"] == "done"
        assert 1 < cell["test_ppl"] < 13  # better than uniform over the 12 fixture words
        assert cell["epochs"] <= 2 and cell["stop_reason"]
        assert cell["seconds_per_epoch"] > 0 and cell["params"] > 0
        results = json.loads((out / "cells" / f"{head}-d{d}-s1" / "results.json").read_text())
        assert results["test_ppl"] == cell["test_ppl"]
    # MoS adds the latent projection and the prior to softmax's parameters.
    assert cells[("mos", 4, 1)]["params"] > cells[("softmax", 4, 1)]["params"]
    study = json.loads((out / "study.json").read_text())
    summary = {(e["head"], e["d"]): e for e in study["summary"]}
    gain = summary[("softmax", 4)]["test_ppl"] - summary[("mos", 4)]["test_ppl"]
    np.testing.assert_allclose(summary[("mos", 4)]["gain_ppl"], gain, rtol=1e-6)
    # Ranks for rank_d = 4, one per head, from experiments/rank.py --mode model.
    assert [r["head"] for r in study["ranks"]] == ["softmax", "mos"]
    assert all(r["numerical_rank"] >= 1 for r in study["ranks"])
    assert (out / "rank" / "mos" / "spectrum.png").exists()
    text = (out / "study.md").read_text()
    assert "| 4 | mos |" in text and "numerical rank" in text


def test_finished_cells_are_skipped_and_a_longer_budget_resumes_them(env, smoke, tmp_path):
    reference, _ = smoke
    out = tmp_path / "study"
    flags = ["--rank_d", "none", "--out_dir", str(out)]  # rank: the smoke grid checks it
    code, _, stderr = _run(env, *flags, "--epochs", "1")
    assert code == 0, stderr
    assert {c["epochs"] for c in _cells(out).values()} == {1}

    code, stdout, stderr = _run(env, *flags)  # the preset's 2 epochs: each cell resumes
    assert code == 0, stderr
    assert stdout.count("resumed") == 2
    got, want = _cells(out), _cells(reference)
    for key, cell in got.items():
        assert cell["epochs"] == want[key]["epochs"] == 2
        # Resumed from epoch 1's checkpoint, the cell is the uninterrupted reference cell.
        np.testing.assert_allclose(cell["test_ppl"], want[key]["test_ppl"], rtol=1e-5)

    code, stdout, stderr = _run(env, *flags)  # nothing left to do
    assert code == 0, stderr
    assert "resumed" not in stdout and "epoch 1/" not in stderr


def test_a_failing_cell_is_recorded_and_the_others_finish(env, tmp_path):
    out = tmp_path / "study"
    blocked = out / "cells" / "mos-d4-s1"
    blocked.mkdir(parents=True)
    (blocked / "config.json").write_text(json.dumps({"experiment": "synthetic"}))
    code, stdout, stderr = _run(env, "--rank_d", "none", "--out_dir", str(out))
    assert code == 1
    assert "cell mos-d4-s1 failed" in stderr and "holds a run of synthetic" in stderr
    cells = _cells(out)
    assert cells[("softmax", 4, 1)]["status"] == "done"
    assert cells[("mos", 4, 1)]["status"] == "failed"
    assert "mos-d4-s1: " in (out / "study.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heads", "softmax,nope"], "unknown head(s) ['nope']"),
        (["--ds", "4,4"], "ds has repeated values"),
        (["--rank_d", "16"], "rank_d 16 is not one of ds (4,)"),
        (["--lr", "nan"], "lr must be finite"),
        (["--patience", "0"], "patience must be >= 1"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm_study.main(["--preset", "smoke", "--out_dir", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
