"""Multi-device equivalence checks, run by tests/test_sharding.py in a subprocess.

The subprocess sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts, so
these run on 8 fake CPU devices; each case returns the largest deviation from one device.
Run directly: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_cases.py``.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bottleneck import nn
from bottleneck.data.synthetic import dirichlet_targets, expected_cross_entropy
from bottleneck.nn.models import ContextEmbeddingModel
from bottleneck.sharding import make_mesh, require_data_divides, shard_batch, shard_model
from bottleneck.train import Trainer, make_optimizer

MESHES = ("data=8", "vocab=8", "data=2,vocab=4")
DIM, VOCAB_SIZE, TOKENS = 8, 37, 40  # 37 is split unevenly: padded decoder rows are exercised
OPTIONS = {
    "plif": {"num_knots": 64, "plif_noise": 1.0},
    "monotone_mlp": {"num_hidden": 3},
    "mos": {"num_components": 3},
    "moss": {"num_components": 3},
    "mos_plif": {"num_components": 3, "num_knots": 64, "plif_noise": 1.0},
}


def _max_deviation(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _loss_and_grads(head, h, labels, where):
    graphdef, state = nnx.split(head)

    def loss(state, h):
        return nnx.merge(graphdef, state).loss(h, labels, where)

    value, (grad_state, grad_h) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, h)
    grads = {k: v for k, v in nnx.to_pure_dict(grad_state).items()}
    return value, grads, grad_h


def head_case(name: str, mesh_spec: str, memory_budget: int) -> float:
    """Loss and gradients of a vocab/data-parallel head equal the single-device ones."""
    mesh = make_mesh(mesh_spec)

    def make(**mesh_option):
        return nn.make_head(
            name, DIM, VOCAB_SIZE, rngs=nnx.Rngs(0), memory_budget=memory_budget,
            **OPTIONS.get(name, {}), **mesh_option,
        )  # fmt: skip

    single, sharded = make(), make(mesh=mesh)
    # A mesh changes no parameter: the decoder and bias only gain zero padding rows.
    single_params = nnx.to_pure_dict(nnx.state(single))
    for key, value in nnx.to_pure_dict(nnx.state(sharded)).items():
        if key in ("decoder", "bias"):
            assert not np.any(np.asarray(value[VOCAB_SIZE:])), f"padding rows of {key} are not 0"
            value = value[:VOCAB_SIZE]
        assert jax.tree.all(jax.tree.map(np.array_equal, value, single_params[key])), key
    shard_model(sharded, mesh)

    keys = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(keys[0], (TOKENS, DIM))
    labels = jax.random.randint(keys[1], (TOKENS,), 0, VOCAB_SIZE)
    where = jax.random.bernoulli(keys[2], 0.8, (TOKENS,))
    want_loss, want_grads, want_h = _loss_and_grads(single, h, labels, where)
    got_loss, got_grads, got_h = _loss_and_grads(
        sharded, shard_batch(h, mesh), shard_batch(labels, mesh), shard_batch(where, mesh)
    )
    for key in ("decoder", "bias"):
        assert not np.any(np.asarray(got_grads[key][VOCAB_SIZE:])), "padding rows got a gradient"
        got_grads[key] = got_grads[key][:VOCAB_SIZE]
    # 37 tokens divide over no data axis: label_log_probs pads them.
    label_log_probs = nnx.jit(lambda head, h, y: head.label_log_probs(h, y))
    want_lp = label_log_probs(single, h[:37], labels[:37])
    got_lp = label_log_probs(sharded, h[:37], labels[:37])
    assert got_lp.shape == (37,)
    return max(
        abs(float(got_loss - want_loss)),
        _max_deviation(got_grads, want_grads),
        _max_deviation(got_h, want_h),
        _max_deviation(got_lp, want_lp),
    )


def synthetic_case(mesh_spec: str) -> float:
    """A few full-batch steps of the synthetic experiment's model match one device.

    SGD rather than Adam: Adam divides by the gradient's magnitude, so for near-zero gradients
    it turns reduction-order round-off (~1e-7) into O(lr) differences in the parameters.
    """
    targets = dirichlet_targets(jax.random.key(0), 32, 48, 0.1)

    def train(mesh):
        model = ContextEmbeddingModel(32, 4, 48, "plif", rngs=nnx.Rngs(0), mesh=mesh, num_knots=64)
        batch = targets
        if mesh is not None:
            model, batch = shard_model(model, mesh), shard_batch(targets, mesh)
        trainer = Trainer(
            model, make_optimizer(0.5, optimizer="sgd"), lambda m, t: expected_cross_entropy(t, m())
        )
        return trainer.run(batch, 5)

    return _max_deviation(train(make_mesh(mesh_spec)), train(None))


def bad_shapes_case() -> float:
    """A sharded head refuses labels that do not match h (0.0: it did, with a clear message)."""
    head = nn.make_head("softmax", DIM, VOCAB_SIZE, rngs=nnx.Rngs(0), mesh=make_mesh("data=8"))
    try:
        head.loss(jnp.zeros((TOKENS, DIM)), jnp.zeros((TOKENS + 1,), jnp.int32))
    except ValueError as err:
        return 0.0 if "labels and where must have shape (40,)" in str(err) else 1.0
    return 1.0


def data_divides_case() -> float:
    """--mesh checks: 0.0 if a batch of 3 is refused on data=8 and one of 16 accepted."""
    require_data_divides("data=2,vocab=4", "batch_size", 16)
    try:
        require_data_divides("", "batch_size", 3)
    except ValueError as err:
        return (
            0.0
            if "batch_size 3 must be a multiple of the mesh's data axis (8)" in str(err)
            else 1.0
        )
    return 1.0


def main() -> None:
    assert jax.device_count() == 8, f"run with 8 fake devices, got {jax.device_count()}"
    results = {}
    for mesh_spec in MESHES:
        for name in nn.HEAD_NAMES:
            results[f"head:{name}:{mesh_spec}"] = head_case(name, mesh_spec, 2**30)
        results[f"head:mos_plif:{mesh_spec}:chunked"] = head_case("mos_plif", mesh_spec, 2_000)
        results[f"synthetic:{mesh_spec}"] = synthetic_case(mesh_spec)
    results["errors:bad_shapes"] = bad_shapes_case()
    results["errors:data_divides"] = data_divides_case()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
