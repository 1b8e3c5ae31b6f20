"""Argument validation shared by the pure functions (runs at trace time, never inside jit)."""

from __future__ import annotations

import math
import operator
from typing import Any

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


def require_int(name: str, value: Any, minimum: int, why: str = "") -> int:
    """``value`` as an ``int`` >= ``minimum``; ``ValueError`` naming the option otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}{why}, got {value!r}")
    return number


def require_finite_number(name: str, value: Any, *, positive: bool) -> float:
    """``value`` as a finite float, > 0 (``positive``) or >= 0; ``ValueError`` naming it."""
    bound = "> 0" if positive else ">= 0"
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}") from None
    if not math.isfinite(number) or not (number > 0 if positive else number >= 0):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number
