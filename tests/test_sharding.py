"""Sharded heads and training on 8 fake CPU devices, and two processes with jax.distributed.

JAX fixes its device count when it starts, so the multi-device checks run in subprocesses with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (tests/sharding_cases.py,
tests/multihost_worker.py and the language model's runs on a mesh); this module reads their
results. The language model's one-device reference runs in this process.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from bottleneck.sharding import padded_vocab_size, parse_mesh_spec
from experiments import language_model
from tests.head_combos import PAIRWISE_COMBOS
from tests.script_runs import run_main

TESTS = pathlib.Path(__file__).resolve().parent
TOLERANCE = 1e-5


def _env(devices):
    env = dict(os.environ)
    # The suite's fast-compile flags (tests/conftest.py) stay.
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def sharding_results():
    result = subprocess.run(
        [sys.executable, str(TESTS / "sharding_cases.py")],
        capture_output=True,
        text=True,
        env=_env(8),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


MESHES = ("data=8", "vocab=8", "data=2,vocab=4")
CASES = [f"compose:{combo}:data=2,vocab=4" for combo in PAIRWISE_COMBOS]
PRESET_HEADS = ("softmax", "mos_plif", "mixtape", "mixtape_shared", "mos_linear")
CASES += [f"head:{name}:{mesh}" for mesh in MESHES for name in PRESET_HEADS]
CASES += [f"synthetic:{mesh}" for mesh in MESHES]
CASES += [f"fixed_trunk:{mesh}" for mesh in MESHES]  # a Transformer's decoder E Q (issue #48)
CASES += ["errors:bad_shapes", "errors:bad_labels:data=2,vocab=4", "errors:data_divides"]
CASES += ["checkpoint:data=2,vocab=4"]  # saved sharded, restored onto the same shardings
MEMORY_CASES = [f"memory:{combo}:data=2,vocab=4" for combo in PAIRWISE_COMBOS]


@pytest.mark.parametrize("case", CASES)
def test_sharded_equals_single_device(sharding_results, case):
    """Loss and every gradient (heads), or the training losses (synthetic), within 1e-5."""
    assert sharding_results[case] < TOLERANCE


@pytest.mark.parametrize("case", MEMORY_CASES)
def test_sharded_loss_needs_under_a_quarter_of_each_devices_share_of_the_logits(
    sharding_results, case
):
    assert sharding_results[case] < 1.0


def test_every_case_was_run(sharding_results):
    assert set(sharding_results) == set(CASES + MEMORY_CASES)


LM_SCRIPT = TESTS.parent / "experiments" / "language_model.py"
# A mixture head with latent dropout (every piece of the LM that a mesh touches); vocab=8 pads
# the 12-word fixture vocabulary to 16 rows, data=2,vocab=4 splits the batch of 2 as well.
LM_ARGS = ("smoke", "--head", "mos", "--dropoutl", "0.3")
LM_MESHES = ("vocab=8", "data=2,vocab=4")


def _lm_run(out, devices, *args):
    env = _env(devices)
    return subprocess.Popen(
        [sys.executable, str(LM_SCRIPT), *LM_ARGS, "--out_dir", str(out), *args],
        cwd=TESTS.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(process):
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return stderr  # the run loop's lines ("resumed ...") with the progress bars


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """The LM smoke preset on two 8-device meshes (subprocesses) and, meanwhile, on this
    process's one device (tests/script_runs.py).

    The data=2,vocab=4 run stops after 2 epochs and is resumed from its checkpoint for the
    third, so restoring onto a mesh is covered too.
    """
    root = tmp_path_factory.mktemp("lm_mesh")
    resumed = root / "data=2,vocab=4"
    runs = [
        _lm_run(root / "vocab=8", 8, "--mesh", "vocab=8"),
        _lm_run(resumed, 8, "--mesh", "data=2,vocab=4", "--epochs", "2"),
    ]
    code, _, stderr = run_main(language_model.main, *LM_ARGS, "--out_dir", str(root / "one_device"))
    assert code == 0, stderr[-3000:]
    _finish(runs.pop())
    resume = _lm_run(resumed, 8, "--mesh", "data=2,vocab=4")
    assert "at epoch 3, window 0" in _finish(resume)
    for process in runs:
        _finish(process)
    return root


def _lm_outcome(out):
    """Every loss the run reports (per epoch, final, dynamic evaluation) and its log-probs."""
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    results = json.loads((out / "results.json").read_text())
    losses = [(r["train_loss"], r["valid_loss"]) for r in epochs if r["event"] == "epoch"]
    final = [results[k] for k in ("valid_loss", "test_loss")]
    final += [results["dynamic_eval"][k] for k in ("valid_loss", "test_loss")]
    log_probs = np.concatenate([np.load(f) for f in sorted((out / "log_probs").glob("*.npy"))])
    return np.array(losses), np.array(final), log_probs


@pytest.mark.parametrize("mesh", LM_MESHES)
def test_language_model_smoke_on_a_mesh_matches_one_device(lm_runs, mesh):
    want = _lm_outcome(lm_runs / "one_device")
    got = _lm_outcome(lm_runs / mesh)
    assert want[0].shape == (3, 2)  # three epochs, resumed or not
    for got_part, want_part in zip(got, want, strict=True):
        np.testing.assert_allclose(got_part, want_part, atol=TOLERANCE, rtol=0)
    config = json.loads((lm_runs / mesh / "config.json").read_text())["config"]
    assert config["mesh"] == mesh


def test_two_processes_on_localhost_agree_with_one_device():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    workers = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "multihost_worker.py"), str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(2),
        )
        for i in range(2)
    ]
    outputs = [w.communicate(timeout=300) for w in workers]
    reports = []
    for worker, (stdout, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr[-3000:]
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    assert sorted(r["process"] for r in reports) == [0, 1]
    for report in reports:
        assert report["processes"] == 2 and report["devices"] == 4
        assert abs(report["sharded_loss"] - report["single_device_loss"]) < TOLERANCE


@pytest.mark.parametrize(
    "spec, devices, sizes",
    [
        (None, 8, {"data": 8, "vocab": 1}),
        ("", 4, {"data": 4, "vocab": 1}),
        ("data=2,vocab=4", 8, {"data": 2, "vocab": 4}),
        ("vocab=8", 8, {"data": 1, "vocab": 8}),
        ("vocab=2", 8, {"data": 4, "vocab": 2}),
        ({"data": 1, "vocab": 1}, 1, {"data": 1, "vocab": 1}),
    ],
)
def test_parse_mesh_spec(spec, devices, sizes):
    assert parse_mesh_spec(spec, devices) == sizes


@pytest.mark.parametrize(
    "spec, message",
    [
        ("data=3", "needs data x vocab = 3 devices but 8 are available"),
        ("data=2,vocab=8", "needs data x vocab = 16 devices but 8 are available"),
        ("vocab=3", "vocab=3 does not divide the 8 available device"),
        ("model=8", "mesh must look like 'data=4,vocab=2'"),
        ("data=two", "mesh must look like"),
        ("data=0,vocab=8", "sizes >= 1"),
    ],
)
def test_parse_mesh_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_mesh_spec(spec, 8)
    if "devices but" in message or "does not divide" in message:  # how to get devices on CPU
        assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in str(error.value)


def test_padded_vocab_size():
    assert padded_vocab_size(33_278, None) == 33_278
    from bottleneck.sharding import make_mesh

    assert padded_vocab_size(33_278, make_mesh()) == 33_278  # one device here
