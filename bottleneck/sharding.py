"""Scaling out with JAX's own sharding: the one layer that places heads and models on devices.

Data parallelism shards the token (batch) axis on ``"data"``; vocabulary parallelism shards an
output head's decoder ``W [M, d]`` and bias ``[M]`` on ``"vocab"`` and combines the shards'
running maxima, normalizers and target scores with ``pmax``/``psum`` inside ``shard_map``
(Megatron's vocab-parallel cross-entropy), for every head. Everything else is replicated and
XLA reduces the gradients.

The mesh comes from context, as in Flax: build the model and call it inside
``with jax.set_mesh(make_mesh("data=2,vocab=4")):``. The heads in :mod:`bottleneck.nn` hold the
maths only; this module owns the ``shard_map`` (:func:`run_on_mesh`), the vocabulary padding
(:func:`padded_vocab_size`, :class:`VocabShard`) and the parameter annotations
(:func:`vocab_rows_metadata`). Both axes are ``AxisType.Auto``: with jax >= 0.10 ``jax.make_mesh`` defaults to
``Explicit`` axes, under which a gather from a vocab-sharded table outside ``shard_map`` (the
tied input embedding) raises ``ShardingTypeError``.

Multi-host: call :func:`initialize_distributed` (``jax.distributed.initialize``) first in every
process; :func:`make_mesh` then spans the devices of all processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"
VOCAB = "vocab"
MESH_AXES = (DATA, VOCAB)


def parse_mesh_spec(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """``"data=4,vocab=2"`` -> ``{"data": 4, "vocab": 2}``; the sizes must use every device.

    ``None`` or ``""`` puts all devices on ``data``. An axis left out has size 1, except that
    ``data`` absorbs the remaining devices when only ``vocab`` is given.
    """
    if spec is None or spec == "":
        return {DATA: num_devices, VOCAB: 1}
    if isinstance(spec, str):
        sizes: dict[str, int] = {}
        for part in spec.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in MESH_AXES or not value.strip().isdigit():
                raise ValueError(
                    f"mesh must look like 'data=4,vocab=2' with axes {MESH_AXES}, got {spec!r}"
                )
            sizes[name] = int(value)
    else:
        sizes = dict(spec)
    unknown = set(sizes) - set(MESH_AXES)
    if unknown or any(v < 1 for v in sizes.values()):
        raise ValueError(f"mesh axes must be {MESH_AXES} with sizes >= 1, got {sizes}")
    cpu_hint = "; on CPU, run with XLA_FLAGS=--xla_force_host_platform_device_count=N for N devices"
    if DATA not in sizes:
        vocab = sizes.get(VOCAB, 1)
        if num_devices % vocab:
            raise ValueError(
                f"mesh {spec!r}: vocab={vocab} does not divide the {num_devices} available "
                f"device(s){cpu_hint}"
            )
        sizes[DATA] = num_devices // vocab
    sizes.setdefault(VOCAB, 1)
    if sizes[DATA] * sizes[VOCAB] != num_devices:
        raise ValueError(
            f"mesh {spec!r} needs data x vocab = {sizes[DATA] * sizes[VOCAB]} devices but "
            f"{num_devices} are available{cpu_hint}"
        )
    return {DATA: sizes[DATA], VOCAB: sizes[VOCAB]}


def make_mesh(
    spec: str | Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``("data", "vocab")`` mesh with ``Auto`` axes over ``devices`` (default: all).

    Example:
      >>> mesh = make_mesh()  # every device on "data"
      >>> tuple(mesh.axis_names)
      ('data', 'vocab')
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh_spec(spec, len(devices))
    return jax.make_mesh(
        (sizes[DATA], sizes[VOCAB]),
        MESH_AXES,
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices,
    )


def use_mesh(mesh: Mesh | None) -> contextlib.AbstractContextManager[Any]:
    """``jax.set_mesh(mesh)`` as a context manager; no context for ``None`` (one device)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def mesh_from_flag(spec: str | None) -> Mesh | None:
    """The mesh an experiment's ``--mesh`` flag asks for; ``None`` when that is one device.

    ``""`` (the flags' default) puts every device on ``data``; on a one-device machine the
    plain single-device code runs.
    """
    mesh = make_mesh(spec or None)
    return mesh if mesh.size > 1 else None


def require_data_divides(mesh_spec: str | None, name: str, size: int) -> None:
    """``ValueError`` unless ``size`` (a batch, a set of contexts) splits evenly on ``data``.

    ``mesh_spec`` is an experiment's ``--mesh`` flag (``""``: every device on ``data``); checked
    against this process's devices, so a bad flag fails before any work starts.
    """
    shards = parse_mesh_spec(mesh_spec or None, jax.device_count())[DATA]
    if size % shards:
        raise ValueError(
            f"{name} {size} must be a multiple of the mesh's data axis ({shards}); choose "
            f"another --{name} or --mesh"
        )


def context_mesh() -> AbstractMesh | None:
    """The mesh set by ``jax.set_mesh`` (or ``with jax.set_mesh(...)``); ``None`` when none is."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def axis_size(mesh: Mesh | AbstractMesh | None, name: str) -> int:
    """Size of mesh axis ``name`` (1 without a mesh or without that axis)."""
    return 1 if mesh is None else dict(mesh.shape).get(name, 1)


def padded_vocab_size(vocab_size: int, mesh: Mesh | AbstractMesh | None = None) -> int:
    """``vocab_size`` rounded up to a multiple of the ``vocab`` axis (shards must be equal).

    ``mesh`` defaults to the context mesh. A vocabulary-parallel head stores this many decoder
    rows; the extra rows are masked out of every normalizer. A tied input embedding must have
    this many rows too.
    """
    shards = axis_size(context_mesh() if mesh is None else mesh, VOCAB)
    return shards * math.ceil(vocab_size / shards)


def vocab_rows_metadata(ndim: int) -> dict[str, Any]:
    """``nnx.Param`` metadata that splits a ``[rows, ...]`` table on the context mesh's ``vocab``.

    Empty without vocabulary parallelism. With it, Flax places the parameter as it is created
    (the ``out_sharding`` annotation of ``kernel_metadata``), and :func:`run_on_mesh` reads the
    annotation back as the table's partition spec.
    """
    if axis_size(context_mesh(), VOCAB) == 1:
        return {}
    return {"out_sharding": (VOCAB,) + (None,) * (ndim - 1)}


def split_rows_by_vocab(table: Any) -> None:
    """Annotates an existing ``nnx.Param`` table ``[rows, ...]`` as vocab-split and places it.

    For a table shared with a vocabulary-parallel head (a tied input embedding) that was
    created without the annotation. A no-op without vocabulary parallelism.
    """
    metadata = vocab_rows_metadata(table.ndim)
    if metadata:
        table.set_metadata(**metadata)
        spec = P(*metadata["out_sharding"])
        table.set_value(
            jax.device_put(table.get_value(), NamedSharding(jax.sharding.get_mesh(), spec))
        )


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """The vocabulary columns one computation holds: all of them, or its shard of a mesh.

    Attributes:
      size: ``M``, the real vocabulary size (columns at or beyond it are padding).
      axis: the mesh axis the columns are split over inside ``shard_map``, or ``None``.
    """

    size: int
    axis: str | None = None

    def offset(self, local_columns: int) -> jax.Array | int:
        """Global index of this shard's first column."""
        return 0 if self.axis is None else jax.lax.axis_index(self.axis) * local_columns

    def local_labels(self, labels: jax.Array, local_columns: int) -> tuple[jax.Array, jax.Array]:
        """Each label's row in this shard's ``local_columns`` (clipped) and whether it is here."""
        local = jnp.asarray(labels).astype(jnp.int32) - self.offset(local_columns)
        in_shard = (local >= 0) & (local < local_columns)
        return jnp.clip(local, 0, local_columns - 1), in_shard

    def mask_padding(self, scores: jax.Array) -> jax.Array:
        """``scores [..., M_local]`` with the padding columns at ``-inf`` (a no-op without any)."""
        local = scores.shape[-1]
        shards = 1 if self.axis is None else jax.lax.axis_size(self.axis)
        if local * shards == self.size:
            return scores
        columns = self.offset(local) + jnp.arange(local)
        return jnp.where(columns < self.size, scores, -jnp.inf)


def run_on_mesh(
    module: Any,
    local: Callable[..., jax.Array],
    vocab_size: int,
    h: jax.Array,
    labels: jax.Array,
    where: jax.Array | None,
    constants: jax.Array | None,
    *,
    per_token: bool,
) -> jax.Array:
    """``local(module, h, labels, where, constants, vocab=, data_axis=, devices=)`` on the context mesh.

    Without a mesh (or on one device) it is a plain call with the whole vocabulary. On a
    ``("data", "vocab")`` mesh it runs under ``shard_map``: the tokens are flattened and padded
    to a multiple of ``data`` (padding masked out in ``where``), each device gets one contiguous
    block of them, the parameters annotated by :func:`vocab_rows_metadata` are split on
    ``vocab`` and everything else is replicated. Inputs ``[T, B]`` sharded on ``B`` should come
    batch-major (``[B, T]``) so that the flattening moves no data.

    Args:
      module: an NNX module (a head); ``local`` gets this device's view of it.
      local: the computation on one device's tokens and vocabulary columns.
      vocab_size: ``M`` (real columns).
      h, labels, where, constants: ``[..., d]``, ``[...]``, ``[...]`` or ``None``, ``[..., c]``
        or ``None``.
      per_token: ``local`` returns one value per token (``[N]``, reshaped to ``labels.shape``)
        rather than a scalar.
    """
    from flax import nnx  # the mesh helpers above do not need Flax

    mesh = context_mesh()
    data, vocab = axis_size(mesh, DATA), axis_size(mesh, VOCAB)
    if data * vocab == 1:
        return local(
            module,
            h,
            labels,
            where,
            constants,
            vocab=VocabShard(vocab_size),
            data_axis=None,
            devices=1,
        )
    if jnp.shape(labels) != h.shape[:-1] or (
        where is not None and jnp.shape(where) != h.shape[:-1]
    ):
        raise ValueError(
            f"labels and where must have shape {h.shape[:-1]} (h {h.shape} without its "
            f"feature axis), got {jnp.shape(labels)} and {jnp.shape(where)}"
        )
    num_tokens, token_dims, shape = labels.size, labels.ndim, labels.shape
    flat = lambda x: x.reshape(num_tokens, *x.shape[token_dims:])  # noqa: E731
    h, labels = flat(h), flat(labels)
    where = jnp.ones((num_tokens,), bool) if where is None else flat(jnp.asarray(where, bool))
    constants = None if constants is None else flat(constants)
    padding = -num_tokens % data
    if padding:
        pad = lambda x: jnp.pad(x, [(0, padding)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
        h, labels, where = pad(h), pad(labels), pad(where)
        constants = None if constants is None else pad(constants)
    graphdef, state = nnx.split(module)
    shard = VocabShard(vocab_size, VOCAB if vocab > 1 else None)

    def on_device(state, h, labels, where, constants):
        return local(
            nnx.merge(graphdef, state), h, labels, where, constants,
            vocab=shard, data_axis=DATA, devices=data * vocab,
        )  # fmt: skip

    result = jax.shard_map(
        on_device,
        in_specs=(nnx.get_partition_spec(state), P(DATA, None), P(DATA), P(DATA), P(DATA, None)),
        out_specs=P(DATA) if per_token else P(),
    )(state, h, labels, where, constants)
    return result[:num_tokens].reshape(shape) if per_token else result


def shard_batch(x: Any, mesh: Mesh, axis: int = 0) -> Any:
    """Places arrays with their token/batch axis (``axis``, default the leading one) on ``data``."""
    return jax.device_put(x, NamedSharding(mesh, P(*([None] * axis), DATA)))


def replicate(x: Any, mesh: Mesh) -> Any:
    """Places arrays fully replicated on ``mesh``."""
    return jax.device_put(x, NamedSharding(mesh, P()))


def initialize_distributed(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    cpu_collectives: str = "gloo",
    **kwargs: Any,
) -> None:
    """Joins a multi-process (multi-host) JAX run: ``jax.distributed.initialize``.

    Call it in every process before any other JAX call; afterwards ``jax.devices()`` lists the
    devices of all processes and :func:`make_mesh` spans them. Each process feeds its own
    slice of the batch (``jax.make_array_from_process_local_data``). On CPU the processes talk
    through ``cpu_collectives`` (gloo; tested with two processes on localhost), which must be
    chosen before the backend starts; GPUs and TPUs ignore it.
    """
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        **kwargs,
    )


def shard_model(model: Any, mesh: Mesh) -> Any:
    """Places every variable of an NNX ``model`` on ``mesh`` as its ``out_sharding`` metadata says.

    Vocabulary-parallel heads annotate their decoder and bias with ``("vocab", None)``;
    variables without an annotation are replicated. Returns ``model`` (updated in place). A
    model built inside ``with jax.set_mesh(mesh)`` is placed already.
    """
    from flax import nnx  # the mesh helpers above do not need Flax

    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    return model
