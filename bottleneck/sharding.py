"""Scaling out with JAX's own sharding: a ``("data", "vocab")`` mesh and its partition specs.

Data parallelism shards the token (batch) axis on ``"data"``; vocabulary parallelism shards an
output head's decoder ``W [M, d]`` and bias ``[M]`` on ``"vocab"`` and combines the shards'
running maxima, normalizers and target scores with ``pmax``/``psum`` inside ``shard_map``
(Megatron's vocab-parallel cross-entropy), for every head; see
:meth:`bottleneck.nn.OutputHead.loss`. Everything else is replicated and XLA reduces
the gradients. Both axes are ``AxisType.Auto``: with jax >= 0.10 ``jax.make_mesh`` defaults to
``Explicit`` axes, under which a gather from a vocab-sharded table outside ``shard_map`` (the
tied input embedding) raises ``ShardingTypeError``.

Multi-host: call :func:`initialize_distributed` (``jax.distributed.initialize``) first in every
process; :func:`make_mesh` then spans the devices of all processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
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


def axis_size(mesh: Mesh | None, name: str) -> int:
    """Size of mesh axis ``name`` (1 without a mesh or without that axis)."""
    return 1 if mesh is None else dict(mesh.shape).get(name, 1)


def padded_vocab_size(vocab_size: int, mesh: Mesh | None) -> int:
    """``vocab_size`` rounded up to a multiple of the ``vocab`` axis (shards must be equal).

    A vocabulary-parallel head stores this many decoder rows; the extra rows are masked out
    of every normalizer. A tied input embedding must have this many rows too.
    """
    shards = axis_size(mesh, VOCAB)
    return shards * math.ceil(vocab_size / shards)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Mesh axes over which ``x`` differs between shards inside ``shard_map`` (empty outside)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def mark_varying(x: jax.Array, axes: Sequence[str] | frozenset[str]) -> jax.Array:
    """Inside ``shard_map``, types ``x`` as varying over ``axes`` too (``jax.lax.pcast``).

    A no-op for axes ``x`` already varies over and outside ``shard_map``. Its transpose sums over
    the added axes, so a replicated parameter marked this way gets the sum of the shards'
    gradient contributions.
    """
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


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
    variables without an annotation are replicated. Returns ``model`` (updated in place).
    """
    from flax import nnx  # the mesh helpers above do not need Flax

    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    return model
