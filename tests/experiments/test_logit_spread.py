"""experiments/logit_spread.py on smoke runs of both model families: the bounds it states hold."""

import json
import math

import numpy as np
import pytest

from bottleneck.runs.language_model import load_run
from experiments import logit_spread


@pytest.fixture(scope="module")
def runs(smoke_run):
    return {
        "awd_lstm_mos": smoke_run("awd_mos"),
        "transformer_softmax": smoke_run("transformer_softmax"),
    }


@pytest.mark.parametrize("name", ["awd_lstm_mos", "transformer_softmax"])
def test_the_stated_bounds_hold_and_the_file_is_what_it_prints(runs, name, capsys):
    stats = logit_spread.main(["--run_dir", str(runs[name]), "--tokens", "100"])
    vocab_size = len(load_run(runs[name])[1])
    assert json.loads((runs[name] / "logit_spread.json").read_text()) == stats
    assert str(runs[name] / "logit_spread.json") in capsys.readouterr().out
    assert 0 <= stats["logit_spread"] <= stats["spread_bound"]
    assert 0 < stats["entropy"] <= math.log(vocab_size) + 1e-5
    assert 1 / vocab_size - 1e-6 <= stats["max_prob"] <= 1
    if name == "awd_lstm_mos":
        assert stats["head"] == "mos" and stats["model"] == "awd_lstm"
        assert 0 <= stats["latent_saturation"] <= 1
        assert stats["input_norm"] <= math.sqrt(stats["latent_width"])  # tanh latents
        assert 0 < stats["prior_max"] <= 1
    else:
        assert stats["head"] == "softmax" and stats["model"] == "transformer"
        assert "latent_saturation" not in stats


def test_measure_against_a_direct_computation(runs):
    # logit_spread = mean of max - median of the bias-free logits, computed here by hand.
    config, vocabulary, model = load_run(runs["transformer_softmax"])
    windows = np.arange(8, dtype=np.int32).reshape(2, 4) % len(vocabulary)
    stats = logit_spread.measure(model, windows, len(vocabulary))
    h = np.asarray(model.features(windows))
    logits = h @ np.asarray(model.head.decoder[...])[: len(vocabulary)].T
    want = np.mean(logits.max(-1) - np.median(logits, axis=-1))
    np.testing.assert_allclose(stats["logit_spread"], want, rtol=1e-5)
    assert stats["tokens"] == 8


def test_a_run_too_short_for_one_window_is_a_usage_error(runs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        logit_spread.main(["--run_dir", str(runs["transformer_softmax"]), "--tokens", "1"])
    assert exit_info.value.code == 2
    assert "hold no whole window" in capsys.readouterr().err
