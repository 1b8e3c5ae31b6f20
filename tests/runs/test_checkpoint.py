"""CheckpointStore: pytrees by key path, mismatches by path, older checkpoints refused, a full disk."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from bottleneck.runs.checkpoint import CheckpointStore, CheckpointWriteError, checkpoint_contents
from bottleneck.runs.folder import RunFolderError
from bottleneck.train import TrainState
from tests.checkpoint_fakes import fill_disk, save_old_format


def _train_state(seed=0):
    """An TrainState of a small NNX model with Adam: every kind of node the run loop saves."""
    params = nnx.state(nnx.Linear(3, 2, rngs=nnx.Rngs(seed)), nnx.Param)
    return TrainState(
        params=params,
        opt_state=optax.adam(1e-3).init(params),
        average=jax.tree.map(jnp.copy, params),
        num_averaged=jnp.zeros((), jnp.int32),
        step=jnp.array(seed + 5, jnp.int32),
    )


def _items(seed=0):
    state = _train_state(seed)
    return {"state": state, "best_params": state.params, "carry": jnp.arange(2) + seed}


def test_pytrees_are_stored_by_key_path_and_listed_from_metadata(tmp_path):
    items = _items()
    with CheckpointStore(tmp_path) as store:
        store.save(3, items, {"epoch": 1})
        store.save(4, _items(seed=1), {"epoch": 2})
        restored, meta = store.restore(_items(seed=2), step=3)
    chex.assert_trees_all_equal(restored, items)  # NNX State, named tuples, optax's EmptyState
    assert jax.tree.structure(restored) == jax.tree.structure(items) and meta == {"epoch": 1}
    contents = checkpoint_contents(tmp_path, step=3)
    assert sorted(contents) == ["best_params", "carry", "state"]
    assert contents["carry"] == {"array": ("int32", (2,))}  # a pytree that is one array
    assert contents["best_params"] == {
        "bias/value": ("float32", (2,)),
        "kernel/value": ("float32", (3, 2)),
    }
    state = contents["state"]
    assert len(state) == len(jax.tree.leaves(items["state"]))
    assert state["params/kernel/value"] == ("float32", (3, 2))
    assert state["opt_state/0/nu/bias/value"] == ("float32", (2,))
    assert state["opt_state/0/count"] == state["step"] == ("int32", ())
    # The default is the latest checkpoint; a folder without checkpoints says so.
    assert checkpoint_contents(tmp_path)["state"] == state
    with pytest.raises(FileNotFoundError, match="no checkpoint 9 in"):
        checkpoint_contents(tmp_path, step=9)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        checkpoint_contents(tmp_path / "missing")


def test_a_checkpoint_that_does_not_fit_names_the_paths_that_differ(tmp_path):
    saved = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2)), "c": jnp.zeros(1)}
    with CheckpointStore(tmp_path) as store:
        store.save(1, {"tree": saved}, {})
        cases = [
            ({"a": jnp.zeros(3), "b": jnp.zeros((2, 2)), "c": jnp.zeros(1), "d": jnp.zeros(1)},
             "1 missing in the checkpoint: d"),
            ({"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}, "1 unexpected in the checkpoint: c"),
            ({"a": jnp.zeros(3, jnp.int32), "b": jnp.zeros((2, 3)), "c": jnp.zeros(1)},
             "2 of another dtype or shape: a (saved float32[3] vs expected int32[3]), "
             "b (saved float32[2, 2] vs expected float32[2, 3])"),
            ({**saved, **{f"extra{i}": jnp.zeros(1) for i in range(5)}},
             "5 missing in the checkpoint: extra0, extra1, extra2, and 2 more"),
        ]  # fmt: skip
        for template, differences in cases:
            with pytest.raises(ValueError) as error:
                store.restore({"tree": template})
            assert str(error.value) == (
                f"checkpoint 1 in {tmp_path}: item 'tree' does not fit, it was written by a "
                f"different model or optimizer: {differences}"
            )
        with pytest.raises(ValueError, match="holds no item carry \\(it holds tree\\)"):
            store.restore({"carry": saved})


def test_checkpoints_of_the_older_unnamed_format_are_refused_as_misfits(tmp_path):
    save_old_format(tmp_path, 7, _items(), {"epoch": 3})
    assert sorted(checkpoint_contents(tmp_path)["state"])[:2] == ["00000", "00001"]
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(ValueError, match="unexpected in the checkpoint: 00000, 00001, 00002"):
            store.restore(_items(seed=1))


def _leftovers(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "tmp" in p.name)


def test_a_full_disk_is_one_error_and_the_last_checkpoint_stays(tmp_path, monkeypatch, caplog):
    items = _items()
    with CheckpointStore(tmp_path) as store:
        store.save(1, items, {"epoch": 1})
        fill_disk(monkeypatch)
        with pytest.raises(CheckpointWriteError) as error:
            store.save(2, _items(seed=1), {"epoch": 2})
        monkeypatch.undo()
        assert isinstance(error.value, RunFolderError)  # scripts print it as one line
        message = str(error.value)
        assert message.startswith("cannot write checkpoint 2 (item '") and "\n" not in message
        assert f"in {tmp_path}: No space left on device;" in message
        assert message.endswith("the partial checkpoint was deleted and checkpoint 1 is kept")
        assert _leftovers(tmp_path) == [] and store.latest_step() == 1
        # Orbax's own reports of the failure (logged from its threads) were not repeated.
        assert not [r for r in caplog.records if "RESOURCE_EXHAUSTED" in r.getMessage()]
    with CheckpointStore(tmp_path) as store:
        restored, meta = store.restore(_items(seed=2))
    chex.assert_trees_all_equal(restored, items)
    assert meta == {"epoch": 1}


def test_errors_that_are_not_the_filesystems_are_not_write_errors(tmp_path):
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(ValueError, match="Unsupported type") as error:  # Orbax's
            store.save(1, {"tree": {"a": object()}}, {})
        assert not isinstance(error.value, CheckpointWriteError)
        assert store.latest_step() is None
