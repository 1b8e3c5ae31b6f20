"""NT-ASGD, the language-model trainer with the AWD-LSTM, checkpoints, stop signals, log-prob blocks."""

import os
import signal
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bottleneck.data import BpttWindow
from bottleneck.nn.awd_lstm import AWDLSTM, AWDLSTMLanguageModel
from bottleneck.runs.checkpoint import CheckpointStore
from bottleneck.runs.folder import RunFolderBusy, RunLock, StopSignals
from bottleneck.train import Trainer
from bottleneck.train.lm import LogProbBlockWriter, pad_window, padded_length
from bottleneck.train.nt_asgd import (
    NtAsgdStatus,
    end_of_epoch,
    should_switch_to_averaging,
    update_average,
)


def test_switch_trigger_on_a_scripted_sequence():
    losses = [6.0, 5.0, 4.5, 4.4, 4.45, 4.42, 4.41, 4.43, 4.5, 4.6]
    status, switched_at = NtAsgdStatus(), None
    for epoch, loss in enumerate(losses, start=1):
        outcome = end_of_epoch(status, loss, nonmono=3)
        if outcome.switched:
            switched_at = epoch
        status = outcome.status
    # Epoch 8 (4.43) is the first worse than the best before the last 3 epochs (4.4, epoch 4).
    assert switched_at == 8 and status.averaging
    assert status.best_val_loss == 4.4
    assert not should_switch_to_averaging(losses[:3], 10.0, nonmono=3)  # too little history
    assert should_switch_to_averaging(losses[:7], 4.43, nonmono=3)
    assert not should_switch_to_averaging(losses[:7], 4.39, nonmono=3)  # a new best: no switch
    # Adam never switches (AWD-LSTM averages SGD only); the history still grows.
    assert not end_of_epoch(
        NtAsgdStatus(tuple(losses[:7])), 4.43, nonmono=3, can_switch=False
    ).switched


def test_finetune_stops_on_the_same_trigger_and_keeps_the_best():
    status = NtAsgdStatus(best_val_loss=4.2, averaging=True)
    stops = []
    for loss in [4.1, 4.05, 4.07, 4.06, 4.08, 4.2]:
        outcome = end_of_epoch(status, loss, nonmono=2, finetune=True)
        status = outcome.status
        stops.append(status.finished)
    assert stops == [False, False, False, False, True, True] and status.best_val_loss == 4.05
    # In the training run's averaging phase there is no stopping, only the best.
    outcome = end_of_epoch(NtAsgdStatus((5.0,) * 9, 4.0, True), 6.0, nonmono=2)
    assert not outcome.status.finished and not outcome.improved and outcome.status.averaging


def test_running_average_is_the_mean_of_the_iterates():
    iterates = [{"w": jax.random.normal(jax.random.key(i), (3, 2))} for i in range(5)]
    average = {"w": jnp.full((3, 2), 123.0)}  # whatever it was before the switch
    for n, params in enumerate(iterates):
        average = update_average(average, params, n)
    np.testing.assert_allclose(average["w"], np.mean([p["w"] for p in iterates], axis=0), atol=1e-6)


def _window(rng, length=6, batch=2, vocab=16):
    ids = rng.integers(0, vocab, (length + 1, batch)).astype(np.int32)
    return BpttWindow(ids[:-1], ids[1:], length, 1.0)


@pytest.fixture(scope="module")
def trainer():
    model = AWDLSTM(16, emsize=4, nhid=8, nlayers=1, dropout=0.0, dropouth=0.0, dropouti=0.0,
                    dropoute=0.0, wdrop=0.0, rngs=nnx.Rngs(0))  # fmt: skip
    return Trainer(AWDLSTMLanguageModel(model, alpha=2.0, beta=1.0), optax.sgd(0.5))


def test_trainer_averages_iterates_and_scales_the_step(trainer):
    rng = np.random.default_rng(0)
    window = pad_window(_window(rng), 8)
    carry = trainer.initial_carry(2)
    # Deterministic model (no dropout), the same window: the update scales with lr_scale.
    start = jax.tree.map(jnp.copy, trainer.state)
    trainer.window_step(carry, window, 1.0, averaging=False)
    full = jax.tree.map(lambda a, b: a - b, trainer.state.params, start.params)
    trainer.state = jax.tree.map(jnp.copy, start)
    trainer.window_step(carry, window, 0.25, averaging=False)
    quarter = jax.tree.map(lambda a, b: a - b, trainer.state.params, start.params)
    chex.assert_trees_all_close(quarter, jax.tree.map(lambda d: 0.25 * d, full), atol=1e-6)
    # From the switch on, the average is the mean of the iterates after each step.
    trainer.state = trainer.state._replace(num_averaged=jnp.zeros((), jnp.int32))
    seen = []
    for _ in range(4):
        carry, _ = trainer.window_step(carry, pad_window(_window(rng), 8), 1.0, averaging=True)
        seen.append(jax.tree.map(jnp.copy, trainer.state.params))
    assert int(trainer.state.num_averaged) == 4
    mean = jax.tree.map(lambda *ps: sum(ps) / len(ps), *seen)
    chex.assert_trees_all_close(trainer.state.average, mean, rtol=1e-5, atol=1e-7)


def test_checkpoint_round_trip_and_mismatch(tmp_path, trainer):
    items = {"state": trainer.state, "carry": trainer.initial_carry(2)}
    with CheckpointStore(tmp_path / "ckpt", max_to_keep=2) as store:
        assert store.latest_step() is None
        for step in (3, 7, 9):
            store.save(step, items, {"epoch": step, "history": [1.5, 2.5]})
        assert store.latest_step() == 9
        restored, meta = store.restore(items)
        assert meta == {"epoch": 9, "history": [1.5, 2.5]}
        chex.assert_trees_all_equal(restored, items)
        assert jax.tree.structure(restored) == jax.tree.structure(items)
        with pytest.raises(ValueError, match="3 missing in the checkpoint: 0, 1, 2; 2 unexp"):
            store.restore({"carry": [jnp.zeros(3)] * 3})
        with pytest.raises(
            ValueError, match=r"0/h \(saved float32\[2, 4\] vs expected float32\[5, 4\]"
        ):
            store.restore({"carry": trainer.initial_carry(5)})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["7", "9"]  # max_to_keep


def test_stop_signals_turn_the_first_signal_into_a_flag():
    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous


def test_run_lock_is_exclusive_and_takes_over_stale_locks(tmp_path):
    lock_file = tmp_path / ".lock"
    with RunLock(tmp_path):
        assert lock_file.read_text() == str(os.getpid())
    assert not lock_file.exists()
    lock_file.write_text(str(os.getppid()))  # held by a live process
    with pytest.raises(RunFolderBusy, match=f"in use by process {os.getppid()}"):
        RunLock(tmp_path).acquire()
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    lock_file.write_text(finished.stdout.strip())  # its process is gone: stale
    with RunLock(tmp_path):
        assert lock_file.read_text() == str(os.getpid())


def test_log_prob_blocks(tmp_path):
    writer = LogProbBlockWriter(tmp_path / "lp", block_rows=4, max_rows=10)
    rows = np.log(np.full((3, 5), 0.2, np.float32))
    for i in range(5):
        writer.add(rows + i, np.arange(3) + 3 * i)
    assert writer.full
    targets = writer.close()
    shapes = [np.load(f).shape for f in sorted((tmp_path / "lp").iterdir())]
    assert shapes == [(4, 5), (4, 5), (2, 5)] and writer.rows_written == 10
    np.testing.assert_array_equal(targets, np.arange(10))
    assert np.load(tmp_path / "lp" / "block_00002.npy")[0, 0] == pytest.approx(np.log(0.2) + 2)


def test_padding():
    assert [padded_length(n, 8) for n in (1, 8, 9, 70)] == [8, 8, 16, 72]
    raw = _window(np.random.default_rng(0), length=5)
    window = pad_window(raw, 8)  # batch-major, padded after the real steps
    assert window.inputs.shape == (2, 8) and int(window.length) == 5
    np.testing.assert_array_equal(window.inputs[:, :5], raw.inputs.T)
    assert np.all(window.inputs[:, 5:] == 0) and np.all(window.targets[:, 5:] == 0)
    with pytest.raises(ValueError, match="length must be >="):
        pad_window(_window(np.random.default_rng(0), length=9), 8)
