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


# ReLU heads: logits kept at least this far from the kink at 0 (see _relu_bias).
RELU_MARGIN = 0.1


def _relu_bias(head, h) -> jax.Array:
    """Bias [M] that keeps every ReLU-head logit at least RELU_MARGIN away from 0.

    The ReLU normalizer's gradient is (p - 1[y]) / (relu(z) + eps): with a label's logit at
    z = 2e-3 it is ~1/z, and its relative error equals that of z. The logits of the two layouts
    differ by reduction-order round-off (~6e-8 here, CPU-dependent), so such a logit turned that
    into 6e-5 of absolute gradient deviation (fails 1e-5 on some CPUs) - an ill-conditioned
    input, not a sharding error. Rather than loosen the bound, the inputs avoid the kink: +1 on
    even columns, -1 on odd ones, so both branches of relu are still exercised (z < 0 gives the
    constant score log eps and a zero gradient) while |z| >= RELU_MARGIN keeps the gradient and
    its conditioning O(1/RELU_MARGIN). Checked, so a change of initialisation cannot
    silently bring the kink back.
    """
    bias = jnp.where(jnp.arange(VOCAB_SIZE) % 2 == 0, 1.0, -1.0)
    z = h @ head.decoder[...][:VOCAB_SIZE].T + bias
    assert float(jnp.min(jnp.abs(z))) >= RELU_MARGIN, "relu logits too close to the kink"
    return bias


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

    keys = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(keys[0], (TOKENS, DIM))
    if name == "relu":
        bias = _relu_bias(single, h)
        single.bias[...] = bias
        sharded.bias[...] = jnp.pad(bias, (0, sharded.bias.shape[0] - VOCAB_SIZE))
    shard_model(sharded, mesh)
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


BAD_LABEL_HEADS = ("softmax", "relu", "plif", "mos", "mos_plif")


def bad_labels_case(mesh_spec: str) -> float:
    """Out-of-range labels on a mesh: ``ValueError`` when concrete, NaN under ``jit``.

    Labels 37..39 fall in the decoder's padding rows on ``vocab=4`` (40 rows for 37 words):
    out of range too, not a log-probability of -inf. 0.0 if every head behaves, else 1.0.
    """
    mesh = make_mesh(mesh_spec)
    keys = jax.random.split(jax.random.key(2), 3)
    h = shard_batch(jax.random.normal(keys[0], (TOKENS, DIM)), mesh)
    labels = shard_batch(jax.random.randint(keys[1], (TOKENS,), 0, VOCAB_SIZE), mesh)
    where = shard_batch(jax.random.bernoulli(keys[2], 0.8, (TOKENS,)), mesh)
    for name in BAD_LABEL_HEADS:
        head = shard_model(
            nn.make_head(
                name, DIM, VOCAB_SIZE, rngs=nnx.Rngs(0), mesh=mesh, memory_budget=2_000,
                **OPTIONS.get(name, {}),
            ),
            mesh,
        )  # fmt: skip
        graphdef, state = nnx.split(head)

        @jax.jit
        def run(state, h, labels, where, graphdef=graphdef):
            loss = lambda s: nnx.merge(graphdef, s).loss(h, labels, where)  # noqa: E731
            value, grads = jax.value_and_grad(loss)(state)
            return value, grads, nnx.merge(graphdef, state).label_log_probs(h, labels)

        for bad in (VOCAB_SIZE, VOCAB_SIZE + 2, 10**6, -1):
            bad_labels = labels.at[13].set(bad)
            for masked in (False, True):
                value, grads, log_probs = run(state, h, bad_labels, where.at[13].set(not masked))
                case = f"{name}, label {bad}, masked={masked}"
                if not bool(jnp.isnan(value)):
                    return _failed(f"{case}: loss {float(value)} under jit")
                if not all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(grads)):
                    return _failed(f"{case}: a finite gradient under jit")
                nan = np.arange(TOKENS) == 13
                if not np.array_equal(np.isnan(np.asarray(log_probs)), nan):
                    return _failed(f"{case}: label_log_probs NaN at {np.isnan(log_probs)}")
            for method in (head.loss, head.label_log_probs):
                try:
                    method(h, bad_labels)
                except ValueError as err:
                    if "labels must lie in [0, 37)" not in str(err):
                        return _failed(f"{name}.{method.__name__}, label {bad}: {err}")
                else:
                    return _failed(f"{name}.{method.__name__}, label {bad}: no ValueError")
    return 0.0


def _failed(reason: str) -> float:
    print(reason, file=sys.stderr)
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
    results["errors:bad_labels:data=2,vocab=4"] = bad_labels_case("data=2,vocab=4")
    results["errors:data_divides"] = data_divides_case()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
