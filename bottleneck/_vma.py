"""Varying-type helpers for code that may run inside ``jax.shard_map`` (no mesh knowledge).

Inside ``shard_map`` (with ``check_vma``) every value is typed by the mesh axes over which it
differs between shards. Pure functions and custom VJPs only need to keep those types
consistent; they never need to know which mesh, if any, they run on. Outside ``shard_map``
all three helpers are no-ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Mesh axes over which ``x`` differs between shards inside ``shard_map`` (empty outside)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def mark_varying(x: jax.Array, axes: Sequence[str] | frozenset[str]) -> jax.Array:
    """Types ``x`` as varying over ``axes`` too (``jax.lax.pcast``).

    A no-op for axes ``x`` already varies over. Its transpose sums over the added axes, so a
    replicated parameter marked this way gets the sum of the shards' gradient contributions.
    """
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def reduce_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """Sums ``grad`` over the axes where it varies but its ``primal`` does not.

    What a custom VJP returns for a replicated input used with sharded data (PLIF's slopes
    applied to a shard of the logits): each shard's contribution, summed.
    """
    axes = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return jax.lax.psum(grad, axes) if axes else grad
