"""experiments/language_model.py: the smoke run end to end, resuming after SIGTERM, bad flags.

The runs are subprocesses sharing one persistent JAX compilation cache (and XLA's fast compile
mode), so only the first compiles; the kill test uses the smoke preset's shapes on a longer
corpus over the same 12-word vocabulary as the fixture corpus, so it reuses those compilations.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "language_model.py"
sys.path.insert(0, str(SCRIPT.parent))
import language_model  # noqa: E402

# The fixture corpus's vocabulary (tests/data/fixtures/ptb), <eos> closing every line.
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "a", "<unk>", "N", "years", "ago"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax_cache")
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "XLA_FLAGS": "--xla_backend_optimization_level=0",
        "JAX_PLATFORMS": "cpu",
    }


def _start(env, *args):
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _run(env, *args):
    process = _start(env, *args)
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke(env, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    code, stdout, stderr = _run(env, "--preset", "smoke", "--out_dir", str(out))
    assert code == 0, stderr
    return out, stdout


def test_smoke_run_writes_every_output(smoke):
    out, stdout = smoke
    for name in ("config.json", "metrics.jsonl", "results.json", "log_prob_targets.npy"):
        assert (out / name).stat().st_size > 0, name
    epochs = [m for m in _metrics(out) if m["event"] == "epoch"]
    assert [m["epoch"] for m in epochs] == [1, 2, 3]
    for m in epochs:
        assert m["valid_ppl"] > 1 and m["seconds"] > 0 and m["tokens_per_second"] > 0
    assert [m["event"] for m in _metrics(out)][-1] == "test"
    results = json.loads((out / "results.json").read_text())
    assert results["epochs_trained"] == 3 and results["head"] == "softmax"
    assert 1 < results["test_ppl"] < 13  # better than uniform over the 12 words
    assert set(results["dynamic_eval"]) >= {"valid_ppl", "test_ppl", "lr", "lamb", "style"}
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["epochs"] == 3 and config["seed"] == 141
    assert config["experiment"] == "language_model"
    # The data it was trained on: the files' SHA-256 and their token counts.
    fixtures = language_model.FIXTURES_DIR / "ptb"
    assert results["data"]["sha256"] == {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in fixtures.glob("ptb.*.txt")
    }
    assert results["data"]["token_counts"] == {"train": 18, "validation": 4, "test": 11}
    assert results["tokens_used"] == {"train": 18, "validation": 4, "test": 11}
    assert results["stop_reason"] == "epoch budget (3)"
    assert "test_ppl" in stdout
    # log_probs/: blocks of <= 4 rows (logprob_block_tokens) over the 12 words, one row per test
    # target (11 test tokens at batch 1 -> 10 targets); they reproduce the test loss.
    blocks = [np.load(f) for f in sorted((out / "log_probs").iterdir())]
    assert [b.shape for b in blocks] == [(4, 12), (4, 12), (2, 12)]
    assert all(b.dtype == np.float32 for b in blocks)
    log_probs = np.concatenate(blocks)
    np.testing.assert_allclose(np.log(np.sum(np.exp(log_probs), axis=1)), 0.0, atol=1e-5)
    targets = np.load(out / "log_prob_targets.npy")
    nll = -np.mean(log_probs[np.arange(len(targets)), targets])
    np.testing.assert_allclose(nll, results["test_loss"], rtol=1e-5)
    assert len(list((out / "checkpoints").iterdir())) >= 1


def test_finetune_stage_averages_from_the_best_model(env, smoke, tmp_path):
    source, _ = smoke
    out = tmp_path / "finetune"
    code, stdout, stderr = _run(
        env, "--preset", "smoke", "--finetune_from", str(source), "--epochs", "2",
        "--no-dynamic_eval", "--max_logprob_tokens", "0", "--out_dir", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    assert f"finetuning {source}" in stdout
    epochs = [m for m in _metrics(out) if m["event"] == "epoch"]
    assert [(m["stage"], m["averaged"]) for m in epochs] == [("finetune", True)] * 2
    # It starts from the best model of the source run, so it is at least as good.
    source_results = json.loads((source / "results.json").read_text())
    assert epochs[0]["best_valid_ppl"] <= source_results["valid_ppl"] * (1 + 1e-6)
    assert not (out / "log_probs").exists()


def _synthetic_corpus(root: Path) -> Path:
    """PTB-named files over the fixture's words: a noisy cycle, so that there is something to learn."""
    rng = np.random.default_rng(0)
    folder = root / "ptb"
    folder.mkdir()
    for split, lines in (("train", 300), ("valid", 40), ("test", 20)):
        text = []
        for _ in range(lines):
            start = rng.integers(len(WORDS))
            words = [WORDS[(start + i) % len(WORDS)] if rng.random() < 0.8 else
                     WORDS[rng.integers(len(WORDS))] for i in range(rng.integers(5, 15))]  # fmt: skip
            text.append(" ".join(words))
        (folder / f"ptb.{split}.txt").write_text("\n".join(text) + "\n")
    return folder


def test_sigterm_then_rerun_resumes_without_losing_or_repeating_epochs(env, smoke, tmp_path):
    data = _synthetic_corpus(tmp_path)
    flags = ["--preset", "smoke", "--data_dir", str(data), "--epochs", "4", "--no-dynamic_eval",
             "--max_logprob_tokens", "20"]  # fmt: skip
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    code, _, stderr = _run(env, *flags, "--out_dir", str(reference))
    assert code == 0, stderr

    process = _start(env, *flags, "--out_dir", str(resumed))
    checkpoints = resumed / "checkpoints"
    deadline = time.monotonic() + 240
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)  # after epoch 1's checkpoint
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM received" in stdout
    killed_epochs = [m["epoch"] for m in _metrics(resumed)]
    assert 1 <= len(killed_epochs) < 4 and killed_epochs == list(range(1, len(killed_epochs) + 1))

    code, stdout, stderr = _run(env, *flags, "--out_dir", str(resumed))
    assert code == 0, stderr
    assert "resumed" in stdout
    got, want = _metrics(resumed), _metrics(reference)
    assert [m["epoch"] for m in got if m["event"] == "epoch"] == [1, 2, 3, 4]
    assert [m["event"] for m in got] == [m["event"] for m in want]
    # Dropout masks and window lengths depend on (seed, epoch, step) only and the recurrent
    # state is checkpointed, so the interrupted run is the uninterrupted one.
    for key in ("train_loss", "valid_loss", "best_valid_ppl", "step"):
        np.testing.assert_allclose([m[key] for m in got if "epoch" in m],
                                   [m[key] for m in want if "epoch" in m], rtol=1e-5, err_msg=key)  # fmt: skip
    results = [json.loads((out / "results.json").read_text()) for out in (resumed, reference)]
    np.testing.assert_allclose(results[0]["test_loss"], results[1]["test_loss"], rtol=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--head", "nope"], "unknown head 'nope'; choose one of softmax"),
        (["--dropout", "1.5"], "dropout must be in [0, 1)"),
        (["--dropoutl", "0.2"], "dropoutl > 0 needs a mixture head"),
        (["--corpus", "wiki"], "corpus must be one of ptb, wikitext2"),
        (["--preset", "huge"], "invalid choice: 'huge'"),
        (["--lr", "nan"], "lr must be finite, got nan"),
        (["--dynamic_eval_lambda", "inf"], "dynamic_eval_lambda must be finite"),
        (["--patience", "0"], "patience must be >= 1 or none, got 0"),
        (["--train_tokens", "0"], "train_tokens must be >= 1 or none, got 0"),
        (
            ["--data_dir", "/nonexistent"],
            "expects the files ptb.train.txt, ptb.valid.txt, ptb.test.txt",
        ),
    ],
)
def test_bad_flags_exit_with_a_clear_message(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        language_model.main(["--preset", "smoke", "--out_dir", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_data_dir_and_env_var(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BOTTLENECK_DATA_DIR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        language_model.main(["--preset", "cpu-small", "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "$BOTTLENECK_DATA_DIR is not set" in err and "ptb.train.txt" in err


def test_resuming_with_other_flags_is_refused(smoke, capsys):
    out, _ = smoke
    with pytest.raises(SystemExit) as exit_info:
        language_model.main(["--preset", "smoke", "--out_dir", str(out), "--lr", "3.0"])
    assert exit_info.value.code == 2
    assert "different config (lr: 1.0 -> 3.0)" in capsys.readouterr().err


def test_a_folder_in_use_by_a_live_run_is_refused(tmp_path, capsys):
    (tmp_path / ".lock").write_text(str(os.getppid()))  # a live process that is not us
    with pytest.raises(SystemExit) as exit_info:
        language_model.main(["--preset", "smoke", "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"is in use by process {os.getppid()}" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()  # refused before touching anything


def test_a_diverged_run_stops_with_a_clear_message_and_keeps_its_last_checkpoint(
    tmp_path, capsys, monkeypatch
):
    # The training loss turns NaN in epoch 2 (as a too large --lr would make it).
    train_epoch = language_model.Run._train_epoch

    def poisoned(run, stop):
        if run.epoch == 1:
            step = run.trainer.train_step

            def nan_step(*args, **kwargs):
                carry, metrics = step(*args, **kwargs)
                return carry, metrics._replace(nll=metrics.nll * np.nan)

            monkeypatch.setattr(run.trainer, "train_step", nan_step)
        return train_epoch(run, stop)

    monkeypatch.setattr(language_model.Run, "_train_epoch", poisoned)
    argv = ["--preset", "smoke", "--no-dynamic_eval", "--epochs", "2", "--out_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        language_model.main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "the training loss became nan in epoch 2" in err
    assert "the checkpoint of epoch 1 is kept" in err
    assert not (tmp_path / "results.json").exists()  # no perplexity of a broken model
    assert [m["epoch"] for m in _metrics(tmp_path)] == [1]

    monkeypatch.setattr(language_model.Run, "_train_epoch", train_epoch)
    results = language_model.main(argv)  # the kept checkpoint resumes
    assert results["epochs_trained"] == 2 and np.isfinite(results["test_loss"])


def test_early_stopping_and_stop_reasons():
    config = language_model.Config(epochs=5, patience=2)
    records = [{"valid_loss": v} for v in (5.0, 4.0, 4.5)]
    assert language_model.epochs_since_best(records) == 1
    assert language_model.epochs_since_best([*records, {"valid_loss": 4.2}]) == 2
    assert language_model.epochs_since_best([*records, {"valid_loss": 3.0}]) == 0
    status = language_model.NtAsgdStatus()
    assert language_model.stop_reason(records, status, config) == "running"
    stopped = [*records, {"valid_loss": 4.2, "early_stop": True}]
    assert language_model.stop_reason(stopped, status._replace(finished=True), config) == (
        "early stopping (no improvement for 2 epochs)"
    )
    full = [{"valid_loss": 1.0 - i / 10} for i in range(5)]
    assert language_model.stop_reason(full, status, config) == "epoch budget (5)"
    finetuned = status._replace(finished=True)
    assert language_model.stop_reason(records, finetuned, config) == "finetune criterion (NT-ASGD)"


def test_a_folder_of_another_experiment_is_refused_before_anything_is_written(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"experiment": "synthetic"}))
    with pytest.raises(SystemExit) as exit_info:
        language_model.main(["--preset", "smoke", "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "holds a run of synthetic, not of language_model" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    with pytest.raises(language_model.UsageError, match="holds a run of synthetic"):
        language_model.run_experiment(language_model.Config(out_dir=str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.skipif(not (ROOT.parent / "shared" / "data" / "ptb").is_dir(), reason="no ../shared")
def test_smoke_on_the_real_corpus_reads_a_few_hundred_tokens(env, tmp_path):
    start = time.monotonic()
    code, _, stderr = _run(
        env, "--preset", "smoke", "--data_dir", str(ROOT.parent / "shared" / "data"),
        "--no-dynamic_eval", "--out_dir", str(tmp_path),
    )  # fmt: skip
    assert code == 0, stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["tokens_used"] == {"train": 200, "validation": 100, "test": 100}
    assert results["data"]["token_counts"]["train"] == 929_589
    assert results["data"]["matches_release"]
    assert time.monotonic() - start < 240  # seconds to minutes, not three PTB epochs
