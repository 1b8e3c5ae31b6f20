"""experiments/language_model.py: the smoke runs end to end, its flags, presets and refusals.

The run loop itself (resuming, stop signals, divergence, finetuning, early stopping) is tested
with a tiny model in tests/runs/test_run_loop.py. The runs here share one persistent JAX
compilation cache of the test run (tests/conftest.py), so only the first compiles; they run in
the test's process (tests/script_runs.py) but for those about the process (a signal, a full
disk, a mesh of 8 devices), which are subprocesses. The Transformer's runs: a plain and a
mixture head on one device, and the mixture head on a vocabulary-parallel mesh of 8 CPU devices
stopped by SIGTERM mid-epoch and resumed (that comparison is tests/test_sharding.py's for the
AWD-LSTM; the one-device run it needs is here).
"""

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bottleneck.data import FIXTURES_DIR
from bottleneck.losses import DEFAULT_MEMORY_BUDGET
from bottleneck.runs import UsageError, language_model, parse_config
from bottleneck.runs.lm_config import HeadConfig
from bottleneck.runs.run_loop import TrainingDiverged
from experiments import language_model as script
from tests.paths import ROOT, SHARED_DATA_DIR
from tests.script_runs import run_main
from tests.usage import plain

SCRIPT = ROOT / "experiments" / "language_model.py"


def _run(*args):
    return run_main(script.main, *args)


# language_model.py that sends itself SIGTERM before training step argv[1] (as an operator's
# kill would, at a step known in advance); the run saves after that step and exits 128 + 15.
STOPPED_AT_STEP = """
import os, signal, sys
from bottleneck.train import Trainer
from experiments import language_model

window_step = Trainer.window_step

def stopping_step(self, *args, **kwargs):
    if int(self.state.step) == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGTERM)
    return window_step(self, *args, **kwargs)

Trainer.window_step = stopping_step
language_model.main(sys.argv[2:])
"""


# language_model.py on a disk that fills up after its first checkpoint (tests/checkpoint_fakes.py:
# TensorStore's error on a full disk, without mounting one).
FULL_DISK_AFTER_ONE_CHECKPOINT = f"""
import sys
import pytest
sys.path[:0] = [{str(SCRIPT.parent)!r}, {str(ROOT)!r}]
import language_model
from tests.checkpoint_fakes import fill_disk

fill_disk(pytest.MonkeyPatch(), spare_checkpoints=1)
language_model.main(sys.argv[1:])
"""


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    code, stdout, stderr = _run("smoke", "--out_dir", str(out))
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
    assert config["config"]["training"]["epochs"] == 3 and config["seed"] == 141
    assert config["experiment"] == "language_model"
    # The data it was trained on: the files' SHA-256 and their token counts.
    fixtures = FIXTURES_DIR / "ptb"
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


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--head", "nope"],
            "invalid choice 'nope' for argument '--head/--head.name'",
        ),
        (["--dropout", "1.5"], "dropout must be in [0, 1)"),
        (["--dropoutl", "0.2"], "dropoutl > 0 needs a mixture head"),
        (["--corpus", "wiki"], "invalid choice 'wiki' for argument"),
        (["huge"], "Unrecognized options: huge"),
        (["--lr", "nan"], "lr must be finite, got nan"),
        (["--dynamic_eval_lambda", "inf"], "dynamic_eval_lambda must be finite"),
        (["--patience", "0"], "patience must be >= 1 or None, got 0"),
        (["--train_tokens", "0"], "train_tokens must be >= 1 or None, got 0"),
        (["model:transformer"], "the transformer trains with --optimizer adamw"),
        (["model:lstm"], "Unrecognized options: model:lstm"),
        (["--d_model", "8"], "Unrecognized or misplaced options: --d_model"),  # not the AWD-LSTM's
        (
            ["transformer-smoke", "--max_len", "7"],
            "max_len 7 must cover the longest window, 8 steps",
        ),
        (["transformer-smoke", "--num_heads", "3"], "num_heads 3 must divide"),
        (
            ["transformer-smoke", "--optimizer", "adamw2"],
            "invalid choice 'adamw2' for argument",
        ),
        (
            ["--data_dir", "/nonexistent"],
            "expects the files ptb.train.txt, ptb.valid.txt, ptb.test.txt",
        ),
    ],
)
def test_bad_flags_exit_with_a_clear_message(args, message, tmp_path, capsys):
    preset = [] if args[0] in language_model.PRESETS else ["smoke"]
    with pytest.raises(SystemExit) as exit_info:
        script.main([*preset, *args, "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    text = plain(capsys.readouterr().err)
    assert message in text, text


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--head", "mos", "--num_components", "1"],
            "num_components must be >= 2 for the mixture preset 'mos' (one component is a plain",
        ),
        (["--head", "plif", "--num_knots", "1"], "head 'plif': num_knots must be >= 2 (one knot"),
        (
            ["--head", "mixtape", "--num_components", "1"],
            "num_components must be >= 2 for the mixture preset 'mixtape'",
        ),
        (["--head", "mos_plif", "--num_knots", "1"], "head 'mos_plif': num_knots must be >= 2"),
        (["--head", "plif", "--plif_bound", "-1"], "plif_bound must be a finite number > 0"),
        (["--head.name", "plif", "--plif_noise", "-1"], "plif_noise must be a finite number >= 0"),
    ],
)
def test_bad_head_options_exit_2_and_write_nothing(args, message, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        script.main(["smoke", "--out_dir", str(out), *args])
    assert exit_info.value.code == 2
    text = plain(capsys.readouterr().err)
    assert message in text, text
    assert not out.exists()  # no config.json, checkpoints/ or tfds/ left behind


def test_head_options_the_head_does_not_take_are_not_checked():
    # num_knots belongs to PLIF: a softmax or mos head ignores it, as on resuming.
    assert HeadConfig("mos", num_knots=1).options() == {"num_components": 15, "latent": "tanh"}
    with pytest.raises(ValueError, match="head 'plif': num_knots must be >= 2"):
        HeadConfig("plif", num_knots=1)


def test_usage_errors_from_the_command_line_exit_2_with_their_reason(tmp_path):
    for args, message in [  # tyro's: its box
        (["--optimizer.lr", "nan"], "lr must be finite, got nan"),
        (["--bogus", "1"], "Unrecognized options: --bogus, 1"),
    ]:
        code, stdout, stderr = _run(*args, "--out_dir", str(tmp_path / "run"))
        assert (code, stdout) == (2, "") and message in plain(stderr)
    assert not any(tmp_path.iterdir())
    missing = str(tmp_path / "no-corpus")
    code, stdout, stderr = _run("--data_dir", missing, "--out_dir", str(tmp_path / "run"))
    assert (code, stdout) == (2, "") and len(stderr.splitlines()) == 1  # the script's: one line
    assert stderr.startswith("language_model.py: error: ") and "ptb.train.txt" in stderr


def test_missing_data_dir_and_env_var(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BOTTLENECK_DATA_DIR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["cpu-small", "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "$BOTTLENECK_DATA_DIR is not set" in err and "ptb.train.txt" in err


def test_help_lists_the_groups_both_spellings_and_what_each_preset_sets(capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for group in ("data", "head", "optimizer", "training", "evaluation", "model"):
        assert f" {group} options " in text, group
    assert "--lr FLOAT, --optimizer.lr FLOAT" in text and "--head {softmax,sigsoftmax," in text
    assert "--emsize INT, --model.emsize INT" in text and "--model.tie_weights" in text
    assert "model:awd_lstm" in text and "model:transformer" in text
    presets = plain(text[text.index("subcommands") :])
    mos_ptb = presets[presets.index(" mos-ptb ") : presets.index(" mos-wt2 ")]
    assert "--head mos" in mos_ptb and "--lr 20.0" in mos_ptb and "--seed 28" in mos_ptb
    assert "--dropouti" not in mos_ptb  # 0.4, the default: only what a preset changes is listed
    cpu = presets[presets.index(" transformer-cpu ") : presets.index(" transformer-study ")]
    assert "model:transformer" in cpu and "--optimizer adamw" in cpu and "--d_model 128" in cpu
    with pytest.raises(SystemExit):  # the chosen model's fields, from its preset
        script.main(["transformer-cpu", "--help"])
    text = capsys.readouterr().out
    assert "--d_model INT, --model.d_model INT" in text and "(default: 128)" in text


def test_dotted_and_short_flags_set_the_same_field(tmp_path):
    base = ["smoke", "--out_dir", str(tmp_path)]
    dotted = parse_config(
        language_model.Config,
        language_model.PRESETS,
        [*base, "--optimizer.lr", "3", "--head.name", "mos"],
    )
    short = parse_config(
        language_model.Config, language_model.PRESETS, [*base, "--lr", "3", "--head", "mos"]
    )
    assert dotted == short and dotted.optimizer.lr == 3.0 and dotted.head.name == "mos"


def test_resuming_with_other_flags_is_refused(smoke, capsys):
    out, _ = smoke
    with pytest.raises(SystemExit) as exit_info:
        script.main(["smoke", "--out_dir", str(out), "--lr", "3.0"])
    assert exit_info.value.code == 2
    assert "different config (optimizer.lr: 1.0 -> 3.0)" in capsys.readouterr().err


def test_a_folder_in_use_by_a_live_run_is_refused(tmp_path, capsys):
    (tmp_path / ".lock").write_text(str(os.getppid()))  # a live process that is not us
    with pytest.raises(SystemExit) as exit_info:
        script.main(["smoke", "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"is in use by process {os.getppid()}" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()  # refused before touching anything


def test_a_full_disk_stops_the_run_with_one_line_and_the_rerun_resumes(env, tmp_path):
    process = subprocess.run(
        [sys.executable, "-c", FULL_DISK_AFTER_ONE_CHECKPOINT, "smoke",
         "--out_dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr and "RESOURCE_EXHAUSTED" not in process.stderr
    (epoch_1,) = _metrics(tmp_path)  # the second epoch's checkpoint failed, so its line too
    checkpoints = tmp_path / "checkpoints"
    error = (
        rf"language_model\.py: error: cannot write checkpoint \d+ \(item '\w+'\) in "
        rf"{re.escape(str(checkpoints))}: No space left on device; the partial checkpoint was "
        rf"deleted and checkpoint {epoch_1['step']} is kept"
    )
    errors = [line for line in process.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and re.fullmatch(error, errors[0]), errors
    assert [p.name for p in checkpoints.iterdir()] == [str(epoch_1["step"])]
    code, stdout, stderr = _run("smoke", "--out_dir", str(tmp_path))
    assert code == 0, stderr
    assert "at epoch 2, window 0" in stderr


def test_a_diverged_run_exits_with_status_1_and_the_loops_message(tmp_path, capsys, monkeypatch):
    # The loop's side (nothing of the broken epoch saved, the last checkpoint resumes) is
    # tests/runs/test_run_loop.py's; here, what the command line makes of it.
    def diverge(config):
        raise TrainingDiverged("the training loss became nan in epoch 2")

    monkeypatch.setattr(script, "run_experiment", diverge)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["smoke", "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 1
    assert "error: the training loss became nan in epoch 2" in capsys.readouterr().err


def test_a_folder_of_another_experiment_is_refused_before_anything_is_written(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"experiment": "synthetic"}))
    with pytest.raises(SystemExit) as exit_info:
        script.main(["smoke", "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "holds a run of synthetic, not of language_model" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    with pytest.raises(UsageError, match="holds a run of synthetic"):
        language_model.run_experiment(language_model.Config(out_dir=str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.skipif(not (SHARED_DATA_DIR / "ptb").is_dir(), reason="no ../shared")
def test_smoke_on_the_real_corpus_reads_a_few_hundred_tokens(tmp_path):
    start = time.monotonic()
    code, _, stderr = _run(
        "smoke", "--data_dir", str(SHARED_DATA_DIR),
        "--no-dynamic_eval", "--out_dir", str(tmp_path),
    )  # fmt: skip
    assert code == 0, stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["tokens_used"] == {"train": 200, "validation": 100, "test": 100}
    assert results["data"]["token_counts"]["train"] == 929_589
    assert results["data"]["matches_release"]
    assert time.monotonic() - start < 240  # seconds to minutes, not three PTB epochs


TRANSFORMER = ("transformer-smoke",)
MIXTURE = (*TRANSFORMER, "--head", "mos", "--no-dynamic_eval")


@pytest.fixture(scope="module")
def transformer_runs(env, tmp_path_factory):
    """Transformer smoke runs: softmax and mos in this process, while mos on ``--mesh vocab=8``
    (12 words padded to 16 rows; a subprocess of 8 devices) is stopped at step 4 (epoch 2) and
    resumed."""
    root = tmp_path_factory.mktemp("transformer")
    mesh_env = {
        **env, "XLA_FLAGS": f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count=8"
    }  # fmt: skip
    mesh_args = [*MIXTURE, "--mesh", "vocab=8", "--out_dir", str(root / "mesh")]

    def start(*args):
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT, env=mesh_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    stopped = start("-c", STOPPED_AT_STEP, "4", *mesh_args)
    for head, args in (("softmax", TRANSFORMER), ("mos", MIXTURE)):
        code, _, stderr = _run(*args, "--out_dir", str(root / head))
        assert code == 0, stderr[-3000:]
    _, stderr = stopped.communicate(timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    resumed = start(str(SCRIPT), *mesh_args)
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "at epoch 2, window" in stderr
    return root


def test_the_transformer_trains_with_a_plain_and_a_mixture_head(transformer_runs):
    for head in ("softmax", "mos"):
        out = transformer_runs / head
        epochs = [m for m in _metrics(out) if m["event"] == "epoch"]
        assert [m["epoch"] for m in epochs] == [1, 2, 3]
        assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
        assert epochs[-1]["valid_loss"] < epochs[0]["valid_loss"]
        assert not any(m["averaged"] for m in epochs)  # AdamW keeps the best; no NT-ASGD
        results = json.loads((out / "results.json").read_text())
        assert (results["model"], results["head"]) == ("transformer", head)
        assert results["test_ppl"] < 12  # better than uniform over the 12 words
        config = json.loads((out / "config.json").read_text())["config"]
        assert config["model"] == "transformer" and config["optimizer"]["name"] == "adamw"
        assert "awd_lstm" not in config  # only the chosen model's fields are recorded
    results = json.loads((transformer_runs / "softmax" / "results.json").read_text())
    assert set(results["dynamic_eval"]) >= {"valid_ppl", "test_ppl", "lr", "lamb", "style"}
    log_probs = np.concatenate(
        [np.load(f) for f in sorted((transformer_runs / "softmax" / "log_probs").iterdir())]
    )
    targets = np.load(transformer_runs / "softmax" / "log_prob_targets.npy")
    nll = -np.mean(log_probs[np.arange(len(targets)), targets])
    np.testing.assert_allclose(nll, results["test_loss"], rtol=1e-5)


def test_the_transformer_on_a_vocab_mesh_resumed_mid_epoch_equals_one_device(transformer_runs):
    def outcome(out):
        epochs = [m for m in _metrics(out) if m["event"] == "epoch"]
        results = json.loads((out / "results.json").read_text())
        losses = [(m["train_loss"], m["valid_loss"]) for m in epochs]
        log_probs = [np.load(f) for f in sorted((out / "log_probs").glob("*.npy"))]
        return losses, [results["valid_loss"], results["test_loss"]], np.concatenate(log_probs)

    want, got = outcome(transformer_runs / "mos"), outcome(transformer_runs / "mesh")
    assert len(want[0]) == 3
    for got_part, want_part in zip(got, want, strict=True):
        np.testing.assert_allclose(got_part, want_part, atol=1e-5, rtol=0)
    config = json.loads((transformer_runs / "mesh" / "config.json").read_text())["config"]
    assert config["mesh"] == "vocab=8"


def test_adamw_runs_refuse_another_epoch_budget_on_resuming(transformer_runs, capsys):
    # The budget sets the length of the cosine decay, which the steps so far followed.
    out = transformer_runs / "mos"
    with pytest.raises(SystemExit) as exit_info:
        script.main([*MIXTURE, "--epochs", "4", "--out_dir", str(out)])
    assert exit_info.value.code == 2
    assert "different config (training.epochs: 3 -> 4)" in capsys.readouterr().err
    config = parse_config(language_model.Config, language_model.PRESETS, MIXTURE)
    assert not any(name.startswith("transformer") for name in config.resumable_changes)
    assert "training.epochs" in language_model.Config().resumable_changes  # SGD: no schedule


def test_head_options_the_head_does_not_take_may_change_on_resuming():
    softmax = language_model.Config(head=HeadConfig("softmax"))
    plif = language_model.Config(head=HeadConfig("plif"))
    mos = language_model.Config(head=HeadConfig("mos"))
    assert {"head.num_knots", "head.latent", "head.num_components"} <= set(
        softmax.resumable_changes
    )
    assert (
        "head.num_knots" not in plif.resumable_changes and "head.latent" in plif.resumable_changes
    )
    assert {"head.latent", "head.num_components"}.isdisjoint(mos.resumable_changes)


def test_the_head_memory_budget_reaches_the_head_and_may_change_on_resuming():
    smoke = language_model.PRESETS["transformer-smoke"]
    mixtape = HeadConfig("mixtape", num_components=4)
    for mib, expected in ((None, DEFAULT_MEMORY_BUDGET), (4, 4 * 2**20), (0.5, 2**19)):
        config = dataclasses.replace(
            smoke, head=dataclasses.replace(mixtape, memory_budget_mib=mib)
        )
        assert language_model.build_model(config, 50).model.head.memory_budget == expected
        assert "head.memory_budget_mib" in config.resumable_changes
    with pytest.raises(ValueError, match="memory_budget_mib must be > 0"):
        HeadConfig(memory_budget_mib=0.0)


def test_mixtape_shares_gates_by_the_training_split_s_counts():
    """--head.shared_gate_below reaches Mixtape with the corpus's counts: the words seen at
    least that often have their own gate; other heads take no such option (and their digests
    cannot change), and a sharing head without counts is refused."""
    smoke = language_model.PRESETS["transformer-smoke"]
    config = dataclasses.replace(
        smoke, head=HeadConfig("mixtape", num_components=2, shared_gate_below=3)
    )
    corpus = type(
        "Corpus", (), {"train": np.array([0, 1, 1, 1, 2, 2, 2, 2, 5]), "vocabulary": range(6)}
    )
    counts = language_model.training_counts(config, corpus)
    np.testing.assert_array_equal(counts, [1, 3, 4, 0, 0, 1])
    head = language_model.build_model(config, 6, counts).model.head
    assert head.shares_gates and head.frequent_rows == ((1, 2),)
    with pytest.raises(ValueError, match="needs the training split's token counts"):
        language_model.build_model(config, 6)
    softmax = dataclasses.replace(config, head=HeadConfig("softmax", shared_gate_below=3))
    assert language_model.training_counts(softmax, corpus) is None
    assert "shared_gate_below" not in softmax.head.options()
    assert softmax.head.unused_fields()[-1] == "shared_gate_below"
    with pytest.raises(ValueError, match="shared_gate_below must be > 0"):
        HeadConfig("mixtape", shared_gate_below=0.0)


def test_a_cosine_shorter_than_the_budget_lets_the_budget_change_on_resuming():
    config = language_model.PRESETS["transformer-study"]
    assert config.optimizer.decay_epochs == 10 and config.training.epochs == 13
    assert "training.epochs" in config.resumable_changes
    whole = dataclasses.replace(
        config, optimizer=dataclasses.replace(config.optimizer, decay_epochs=None)
    )
    assert "training.epochs" not in whole.resumable_changes


def test_configs_check_themselves_when_replaced():
    config = language_model.PRESETS["transformer-study"]
    with pytest.raises(ValueError, match="decay_epochs must be >= 1 or None, got 0"):
        dataclasses.replace(config.optimizer, decay_epochs=0)
    with pytest.raises(ValueError, match="max_len 16 must cover the longest window"):
        dataclasses.replace(config, model=dataclasses.replace(config.model, max_len=16))
    with pytest.raises(ValueError, match="the transformer trains with --optimizer adamw"):
        dataclasses.replace(config, optimizer=language_model.OptimizerConfig())
    with pytest.raises(ValueError, match="dropoutl > 0 needs a mixture head"):
        language_model.Config(model=language_model.AWDLSTMConfig(dropoutl=0.1))


def test_embedding_features_fix_the_transformers_trunk_and_old_folders_still_resume(
    tmp_path, capsys
):
    from bottleneck.nn.heads import ProjectedEmbedding
    from bottleneck.runs.folder import RunFolderError, check_resumable, to_jsonable

    argv = [*TRANSFORMER, "--head_features", "4", "--out_dir", str(tmp_path)]
    config = parse_config(
        language_model.Config, language_model.PRESETS, [*argv, "--embedding_features", "8"]
    )
    assert config.model.embedding_features == 8 == config.model.d_model
    model = language_model.build_model(config, 12).model
    assert isinstance(model.head.decoder, ProjectedEmbedding)
    assert model.head.decoder.shape == (12, 4) and model.embedding.embedding.shape == (12, 8)
    # A folder recorded before the field existed is the run without it, and only that one.
    old = parse_config(language_model.Config, language_model.PRESETS, argv)
    record = to_jsonable(old)
    del record["transformer"]["embedding_features"]
    (tmp_path / "config.json").write_text(json.dumps({"config": record}))
    check_resumable(tmp_path, old)
    with pytest.raises(RunFolderError, match="transformer.embedding_features: None -> 8"):
        check_resumable(tmp_path, config)
    with pytest.raises(SystemExit):
        script.main([*TRANSFORMER, "--help"])
    text = capsys.readouterr().out
    assert "--embedding_features {None}|INT, --model.embedding_features {None}|INT" in text
