"""Argument validation shared by the pure functions (runs at trace time, never inside jit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def require_float(name: str, x: jax.Array) -> None:
    """Raise ``ValueError`` unless ``x`` has a floating dtype."""
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {jnp.asarray(x).dtype}")


def require_ndim(name: str, x: jax.Array, min_ndim: int, shape_doc: str) -> None:
    """Raise ``ValueError`` unless ``x`` has at least ``min_ndim`` dimensions."""
    if jnp.ndim(x) < min_ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {jnp.shape(x)}")


def compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    """The dtype to compute in: float64 if any input is float64, else float32.

    bfloat16 and float16 inputs are widened so that reductions run in float32. Chosen by
    hand rather than by ``jnp.promote_types`` so that it also holds under strict promotion.
    """
    widest = max(jnp.dtype(jnp.asarray(a).dtype).itemsize for a in arrays)
    return jnp.dtype(jnp.float64) if widest >= 8 else jnp.dtype(jnp.float32)


def as_compute(x: jax.Array) -> jax.Array:
    """``x`` cast to :func:`compute_dtype` (a no-op for float32 and float64)."""
    return jnp.asarray(x).astype(compute_dtype(x))
