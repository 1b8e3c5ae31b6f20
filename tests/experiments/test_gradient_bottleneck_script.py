"""experiments/gradient_bottleneck.py on the fixture corpus: curves, files, resumption."""

import json

import jax
import numpy as np
import pytest

from experiments import gradient_bottleneck


@pytest.fixture(autouse=True)
def standard_promotion():
    # optax's AdamW bias correction raises an int32 count to a float power, which the suite's
    # strict promotion (conftest.py) refuses; the scripts run with JAX's default.
    with jax.numpy_dtype_promotion("standard"):
        yield


def test_curves_are_ratios_and_a_rerun_resumes_finished_heads(tmp_path, monkeypatch):
    out = tmp_path / "gb"
    summary = gradient_bottleneck.main(["smoke", "--out_dir", str(out)])
    assert [row["head"] for row in summary] == ["softmax", "mos"]
    saved = json.loads((out / "gradient_bottleneck.json").read_text())
    for curve in saved["curves"]:
        steps = [p["step"] for p in curve["points"]]
        assert steps == [0, 2, 4]
        medians = np.array([p["median"] for p in curve["points"]])
        assert np.all((medians > 0) & (medians <= 1))
        assert curve["points"][0]["train_loss"] is None
        assert all(np.isfinite(p["train_loss"]) for p in curve["points"][1:])
    assert (out / "gradient_bottleneck.png").stat().st_size > 0
    page = (out / "gradient_bottleneck.md").read_text().splitlines()
    assert page[0] == "# Share of the loss gradient passed back to the trunk, d = 4"
    assert page[2].startswith("Written by `python ") and " at commit `" in page[2]
    table = page[4:]
    assert len(table) == 4 and table[2].split("|")[1].strip() == "softmax"

    def no_training(config, head):
        raise AssertionError(f"{head} was finished and must not be trained again")

    monkeypatch.setattr(gradient_bottleneck, "train_head", no_training)
    again = gradient_bottleneck.main(["smoke", "--out_dir", str(out)])
    assert again == summary
    # A subset of the heads reuses their curves too.
    subset = gradient_bottleneck.main(["smoke", "--heads", "mos", "--out_dir", str(out)])
    assert subset == summary[1:]
    # Another configuration in the same folder retrains (here: refused by the stub).
    with pytest.raises(AssertionError, match="must not be trained again"):
        gradient_bottleneck.main(["smoke", "--steps", "6", "--out_dir", str(out)])


def test_unknown_head_and_empty_measurement_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gradient_bottleneck.main(["smoke", "--heads", "softmax", "nope"])
    assert exit_info.value.code == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        gradient_bottleneck.main(["smoke", "--positions", "1", "--out_dir", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "holds no whole window" in capsys.readouterr().err
