"""Multi-device equivalence checks, run by tests/test_sharding.py in a subprocess.

The subprocess sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts, so
these run on 8 fake CPU devices; each case returns the largest deviation from one device.
Run directly: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_cases.py``.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bottleneck as bn
from bottleneck import nn
from bottleneck.data.synthetic import dirichlet_targets, expected_cross_entropy
from bottleneck.nn.models import ContextEmbeddingModel
from bottleneck.runs.checkpoint import CheckpointStore
from bottleneck.sharding import make_mesh, require_data_divides, shard_batch
from bottleneck.train import Trainer, make_optimizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from head_combos import (  # noqa: E402
    PAIRWISE_COMBOS,
    build_head,
    keep_relu_off_its_kink,
    loss_temp_bytes,
)

MESHES = ("data=8", "vocab=8", "data=2,vocab=4")
# Every pair of pieces (tests/head_combos.py) runs on this mesh, the presets on every mesh.
COMPOSITION_MESH = "data=2,vocab=4"
# and their memory budgets; "mixtape_shared" and "mos_linear" are presets with options
PRESET_HEADS = {
    "softmax": 2**30,
    "mos_plif": 2_000,
    "mixtape": 2_000,
    "mixtape_shared": 2_000,
    "mos_linear": 2_000,
}
PRESET_NAMES = {"mixtape_shared": "mixtape", "mos_linear": "mos"}
DIM, VOCAB_SIZE, TOKENS = 8, 37, 40  # 37 is split unevenly: padded decoder rows are exercised
# Rows stored per vocabulary id, split on "vocab" and padded like the decoder.
ROW_PARAMS = ("decoder", "bias", "gate_embedding", "gate_bias")
OPTIONS = {
    "plif": {"num_knots": 64, "plif_noise": 1.0},
    "monotone_mlp": {"num_hidden": 3},
    "mos": {"num_components": 3},
    "moss": {"num_components": 3},
    "mos_plif": {"num_components": 3, "num_knots": 64, "plif_noise": 1.0},
    "mixtape": {"num_components": 4},
    # Counts in no order of id; 17 of 37 tokens keep their own gate, unevenly over the shards.
    "mixtape_shared": {"token_counts": (np.arange(37) * 7) % 5, "shared_gate_below": 3},
    "mos_linear": {"num_components": 3, "latent": "linear"},
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


def _place(head, bias):
    if bias is not None:
        head.bias[...] = jnp.pad(bias, (0, head.bias.shape[0] - VOCAB_SIZE))
    return head


@functools.cache
def single_device_head(build) -> dict:
    """One device's head (``build()``), its inputs and its results: what :func:`head_case`
    compares each mesh's with, computed once per ``build``."""
    head = build()
    params = nnx.to_pure_dict(nnx.state(head))
    keys = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(keys[0], (TOKENS, DIM))
    bias = keep_relu_off_its_kink(head, h)
    head = _place(head, bias)
    labels = jax.random.randint(keys[1], (TOKENS,), 0, VOCAB_SIZE)
    where = jax.random.bernoulli(keys[2], 0.8, (TOKENS,))
    loss, grads, grad_h = _loss_and_grads(head, h, labels, where)
    log_probs = _label_log_probs(head, h[:37], labels[:37])
    return {
        "params": params, "bias": bias, "h": h, "labels": labels, "where": where,
        "loss": loss, "grads": grads, "grad_h": grad_h, "log_probs": log_probs,
    }  # fmt: skip


@nnx.jit
def _label_log_probs(head, h, labels):
    return head.label_log_probs(h, labels)


def head_case(build, mesh_spec: str) -> float:
    """Loss and gradients of a vocab/data-parallel head equal the single-device ones.

    ``build()`` makes the head; on the mesh it is built and run inside ``jax.set_mesh``.
    """
    single = single_device_head(build)
    mesh = make_mesh(mesh_spec)
    with jax.set_mesh(mesh):
        sharded = build()
    # A mesh changes no parameter: the decoder and bias only gain zero padding rows.
    for key, value in nnx.to_pure_dict(nnx.state(sharded)).items():
        if key in ROW_PARAMS:
            assert not np.any(np.asarray(value[VOCAB_SIZE:])), f"padding rows of {key} are not 0"
            value = value[:VOCAB_SIZE]
        assert jax.tree.all(jax.tree.map(np.array_equal, value, single["params"][key])), key

    sharded = _place(sharded, single["bias"])
    h, labels = single["h"], single["labels"]
    with jax.set_mesh(mesh):
        got_loss, got_grads, got_h = _loss_and_grads(
            sharded,
            shard_batch(h, mesh),
            shard_batch(labels, mesh),
            shard_batch(single["where"], mesh),
        )
    for key in ROW_PARAMS:
        if key in got_grads:
            assert not np.any(np.asarray(got_grads[key][VOCAB_SIZE:])), f"padding rows of {key}"
            got_grads[key] = got_grads[key][:VOCAB_SIZE]
    # 37 tokens divide over no data axis: label_log_probs pads them.
    with jax.set_mesh(mesh):
        got_lp = _label_log_probs(sharded, h[:37], labels[:37])
    assert got_lp.shape == (37,)
    return max(
        abs(float(got_loss - single["loss"])),
        _max_deviation(got_grads, single["grads"]),
        _max_deviation(got_h, single["grad_h"]),
        _max_deviation(got_lp, single["log_probs"]),
    )


def composition_case(combo: str, mesh_spec: str) -> float:
    """On the mesh, head.loss and its gradients equal bn.cross_entropy(head(h)) (the plain maths,
    partitioned by XLA), label_log_probs picks head(h)'s entries, and head(h) is normalized: one
    compiled program per composition. The mesh pads 37 words to 40 decoder rows."""
    mesh = make_mesh(mesh_spec)
    keys = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(keys[0], (TOKENS, DIM))
    labels = jax.random.randint(keys[1], (TOKENS,), 0, VOCAB_SIZE)
    where = jax.random.bernoulli(keys[2], 0.8, (TOKENS,))
    with jax.set_mesh(mesh):
        head = build_head(combo, DIM, VOCAB_SIZE, memory_budget=2_000)
        head = _place(head, keep_relu_off_its_kink(head, h))
        graphdef, state = nnx.split(head)

        @jax.jit
        def run(state, h, labels, where):
            chunked = lambda s, h: nnx.merge(graphdef, s).loss(h, labels, where)  # noqa: E731
            full = lambda s, h: bn.cross_entropy(nnx.merge(graphdef, s)(h), labels, where)  # noqa: E731
            grads = lambda f: jax.value_and_grad(f, argnums=(0, 1))(state, h)  # noqa: E731
            model = nnx.merge(graphdef, state)
            log_probs = model(h)
            picked = jnp.take_along_axis(log_probs[:37], labels[:37, None], axis=-1)[:, 0]
            # 37 tokens divide over no data axis: label_log_probs pads them.
            got_picked = model.label_log_probs(h[:37], labels[:37])
            return (
                grads(chunked),
                grads(full),
                (got_picked, picked),
                jax.nn.logsumexp(log_probs, -1),
            )

        got, want, (got_picked, picked), log_total = run(
            state, shard_batch(h, mesh), shard_batch(labels, mesh), shard_batch(where, mesh)
        )
    grad_rows = nnx.to_pure_dict(got[1][0])
    for key in ("decoder", "bias"):
        assert not np.any(np.asarray(grad_rows[key][VOCAB_SIZE:])), "padding rows got a gradient"
    return max(
        _max_deviation(got, want),
        _max_deviation(got_picked, picked),
        float(jnp.max(jnp.abs(log_total))) / 10,  # within 1e-6: float32 round-off over 37 words
    )


def memory_case(combo: str, mesh_spec: str) -> float:
    """Compiled per-device temporaries of value_and_grad(head.loss) on the mesh at N=4096, d=64,
    M=32768, as a fraction of one device's quarter of the full float32 logits (< 1 passes)."""
    num_tokens, dim, vocab = 4096, 64, 32768
    mesh = make_mesh(mesh_spec)
    with jax.set_mesh(mesh):  # shapes only, laid out on the mesh: no table is initialised
        temp = loss_temp_bytes(lambda: build_head(combo, dim, vocab), num_tokens)
    return temp / (num_tokens * vocab * 4 / mesh.size / 4)


def synthetic_case(mesh_spec: str) -> float:
    """A few full-batch steps of the synthetic experiment's model match one device.

    SGD rather than Adam: Adam divides by the gradient's magnitude, so for near-zero gradients
    it turns reduction-order round-off (~1e-7) into O(lr) differences in the parameters.
    """
    mesh = make_mesh(mesh_spec)
    with jax.set_mesh(mesh):
        sharded = _train_synthetic(mesh)
    return _max_deviation(sharded, _synthetic_on_one_device())


def _train_synthetic(mesh):
    targets = dirichlet_targets(jax.random.key(0), 32, 48, 0.1)
    model = ContextEmbeddingModel(32, 4, 48, "plif", rngs=nnx.Rngs(0), num_knots=64)
    batch = targets if mesh is None else shard_batch(targets, mesh)
    trainer = Trainer(
        model, make_optimizer(0.5, optimizer="sgd"), lambda m, t: expected_cross_entropy(t, m())
    )
    return trainer.run(batch, 5)


@functools.cache
def _synthetic_on_one_device():
    return _train_synthetic(None)


def fixed_trunk_case(mesh_spec: str) -> float:
    """A Transformer with its trunk fixed across d (``embedding_features``: the head decodes with
    ``E Q``, the table split on ``vocab``, ``Q`` replicated): the same parameters, loss and
    gradients as on one device (the table's padding rows zero, and zero in the gradient)."""
    mesh = make_mesh(mesh_spec)
    with jax.set_mesh(mesh):
        sharded = _fixed_trunk_model()
    single, x, (want_loss, want_grads) = _fixed_trunk_on_one_device()
    table, projection = sharded.head.decoder.table, sharded.head.decoder.projection
    if table is not sharded.embedding.embedding:
        return _failed("fixed trunk: the decoder's table is not the input embedding")
    if "vocab=" in mesh_spec and table.get_value().sharding.is_fully_replicated:
        return _failed("fixed trunk: the tied table is not split on vocab")
    if not projection.get_value().sharding.is_fully_replicated:
        return _failed("fixed trunk: Q is not replicated")
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(nnx.state(sharded, nnx.Param)),
        nnx.to_flat_state(nnx.state(single, nnx.Param)),
        strict=True,
    ):
        if not np.array_equal(np.asarray(got.get_value())[: want.shape[0]], want.get_value()):
            return _failed(f"fixed trunk: the mesh changed the parameter {path}")
    with jax.set_mesh(mesh):
        got_loss, got_grads = _fixed_trunk_loss_and_grads(sharded, shard_batch(x, mesh))
    deviations = [abs(float(got_loss - want_loss))]
    for path, want in want_grads.items():
        got = np.asarray(got_grads[path])
        if got.shape != want.shape:  # rows per vocabulary id, padded for the mesh
            if np.any(got[VOCAB_SIZE:]):
                return _failed(f"fixed trunk: padding rows of {path} have a gradient")
            got = got[:VOCAB_SIZE]
        deviations.append(float(np.max(np.abs(got - np.asarray(want)))))
    return max(deviations)


def _fixed_trunk_model():
    return nn.Transformer(
        VOCAB_SIZE, d_model=DIM, num_layers=1, num_heads=2, max_len=8, head_features=4,
        embedding_features=DIM, rngs=nnx.Rngs(0),
    )  # fmt: skip


def _fixed_trunk_loss_and_grads(model, x):
    graphdef, state = nnx.split(model, nnx.Param)

    def loss(state):
        return nnx.merge(graphdef, state).objective(x[:, :-1], x[:, 1:])[0]

    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    return value, {path: v.get_value() for path, v in nnx.to_flat_state(grads)}


@functools.cache
def _fixed_trunk_on_one_device():
    single = _fixed_trunk_model()
    x = jax.random.randint(jax.random.key(2), (8, 8), 0, VOCAB_SIZE)
    return single, x, _fixed_trunk_loss_and_grads(single, x)


def bad_shapes_case() -> float:
    """A sharded head refuses labels that do not match h (0.0: it did, with a clear message)."""
    with jax.set_mesh(make_mesh("data=8")):
        head = nn.make_head("softmax", DIM, VOCAB_SIZE, rngs=nnx.Rngs(0))
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
    with jax.set_mesh(mesh):
        return _bad_labels_on(mesh)


def _bad_labels_on(mesh) -> float:
    keys = jax.random.split(jax.random.key(2), 3)
    h = shard_batch(jax.random.normal(keys[0], (TOKENS, DIM)), mesh)
    labels = shard_batch(jax.random.randint(keys[1], (TOKENS,), 0, VOCAB_SIZE), mesh)
    where = shard_batch(jax.random.bernoulli(keys[2], 0.8, (TOKENS,)), mesh)
    for name in BAD_LABEL_HEADS:
        head = nn.make_head(
            name, DIM, VOCAB_SIZE, rngs=nnx.Rngs(0), memory_budget=2_000, **OPTIONS.get(name, {})
        )
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


def _head_with_adam(seed: int) -> dict:
    """A vocab-split MoS head's parameters and Adam state (built on the current mesh)."""
    head = nn.make_head("mos", DIM, VOCAB_SIZE, rngs=nnx.Rngs(seed), num_components=3)
    params = nnx.state(head, nnx.Param)
    return {"params": params, "adam": jax.jit(optax.adam(1e-3).init)(params)}


def checkpoint_case(mesh_spec: str) -> float:
    """Sharded state saved by CheckpointStore, restored onto a fresh state's shardings: the
    largest deviation from the saved values, 1.0 if an array comes back on another sharding or
    nothing was sharded."""
    mesh = make_mesh(mesh_spec)
    with jax.set_mesh(mesh):
        saved, template = _head_with_adam(0), _head_with_adam(1)
    if all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(saved)):
        return _failed("checkpoint: no array of the head is sharded")
    with tempfile.TemporaryDirectory() as folder, CheckpointStore(folder) as store:
        store.save(1, {"state": saved}, {})
        restored = store.restore({"state": template})[0]["state"]
    for got, where in zip(jax.tree.leaves(restored), jax.tree.leaves(template), strict=True):
        if got.sharding != where.sharding:
            return _failed(f"checkpoint: restored on {got.sharding}, not {where.sharding}")
    return _max_deviation(restored, saved)


def main() -> None:
    assert jax.device_count() == 8, f"run with 8 fake devices, got {jax.device_count()}"
    results = {}
    for combo in PAIRWISE_COMBOS:
        results[f"compose:{combo}:{COMPOSITION_MESH}"] = composition_case(combo, COMPOSITION_MESH)
        results[f"memory:{combo}:{COMPOSITION_MESH}"] = memory_case(combo, COMPOSITION_MESH)
    builds = {}  # one per head, across the meshes: its single-device reference is computed once
    for name, memory_budget in PRESET_HEADS.items():
        options = {**OPTIONS.get(name, {}), "memory_budget": memory_budget}

        def build(name=name, options=options):  # fresh streams: the same parameters each time
            preset = PRESET_NAMES.get(name, name)
            return nn.make_head(preset, DIM, VOCAB_SIZE, rngs=nnx.Rngs(0), **options)

        builds[name] = build
    for mesh_spec in MESHES:
        for name, build in builds.items():
            results[f"head:{name}:{mesh_spec}"] = head_case(build, mesh_spec)
        results[f"synthetic:{mesh_spec}"] = synthetic_case(mesh_spec)
        results[f"fixed_trunk:{mesh_spec}"] = fixed_trunk_case(mesh_spec)
    results["errors:bad_shapes"] = bad_shapes_case()
    results["errors:bad_labels:data=2,vocab=4"] = bad_labels_case("data=2,vocab=4")
    results["errors:data_divides"] = data_divides_case()
    results[f"checkpoint:{COMPOSITION_MESH}"] = checkpoint_case(COMPOSITION_MESH)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
