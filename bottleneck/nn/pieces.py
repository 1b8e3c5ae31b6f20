"""The pieces an output head is composed of: pointwise maps and normalizers (Flax NNX).

A pointwise map ``f`` acts on each logit (:class:`PLIF`, :class:`MonotoneMLP`, or any increasing
callable); a normalizer is an elementwise log-score ``z -> log g(z)`` normalized over the
vocabulary (:data:`NORMALIZERS`, or any callable). Each library piece declares the float32
buffers per logit it keeps live at the peak of a chunk's value and gradient
(``buffers_per_logit``), for :meth:`bottleneck.nn.OutputHead.loss`'s chunk sizing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bottleneck._checks import require_finite_number, require_int
from bottleneck.monotone import ONE_KNOT, monotone_mlp, monotone_mlp_init, plif, plif_init
from bottleneck.normalizers import (
    relu_log_scores,
    sigmoid_log_scores,
    sigsoftmax_log_scores,
    softmax_log_scores,
)

# Memory of the pieces, for the chunk sizing of `OutputHead.loss`: `buffers_per_logit` is the
# number of float32 buffers the size of the logits that a piece adds at the peak of one chunk's
# value and gradient, measured with compiled.memory_analysis() on XLA:CPU (tests/nn/test_heads.py
# checks that a chunk stays within its budget). The head itself holds 2 (the logits and their
# gradient). A piece that declares nothing is measured (`measure_buffers_per_element`).
HEAD_BUFFERS_PER_LOGIT = 2.0


@dataclasses.dataclass(frozen=True)
class Normalizer:
    """A normalizer's elementwise log-score ``z -> log g(z)`` with its declared memory.

    ``log_normalize(log_scores(z))`` is the normalizer; e.g. softmax ``z``, sigsoftmax
    ``z + log sigma(z)`` (Kanai et al. 2018, eq. 11).
    """

    log_scores: Callable[[jax.Array], jax.Array]
    buffers_per_logit: float

    def __call__(self, z: jax.Array) -> jax.Array:
        return self.log_scores(z)


NORMALIZERS: dict[str, Normalizer] = {
    "softmax": Normalizer(softmax_log_scores, 0.0),
    "sigsoftmax": Normalizer(sigsoftmax_log_scores, 1.0),
    "sigmoid": Normalizer(sigmoid_log_scores, 1.0),
    "relu": Normalizer(relu_log_scores, 1.0),
}


def relu_normalizer(eps: float = 1e-8) -> Normalizer:
    """Kanai's ReLU normalizer ``(relu(z) + eps) / sum (relu + eps)`` (eq. 34) with its ``eps``."""
    eps = require_finite_number("eps", eps, positive=True)
    return Normalizer(functools.partial(relu_log_scores, eps=eps), 1.0)


class PLIF(nnx.Module):
    """LMS-PLIF (Ganea et al. 2019) as a module: learned slopes ``raw_slopes [K]`` and :func:`bn.plif`.

    Args:
      num_knots: ``K >= 2`` segments on ``[-bound, bound]`` (10^5 in the paper). ``bn.plif``
        takes ``K = 1`` (an affine map), but the module refuses it: ``log_softmax`` of an
        affine map of the logits is a softmax with a learned temperature, not the nonlinear
        map a PLIF stands for.
      bound: ``T``, finite and > 0.
      noise: std (finite, >= 0) of the Gaussian noise added to the identity slopes at init.
      rngs: NNX random streams (``params``).

    The slopes are the parameter ``raw_slopes``; give them their own learning rate (0.02 in
    the paper) with :func:`param_labels`.
    """

    buffers_per_logit = 5.5  # its gather, scatter-add and index arithmetic

    def __init__(self, num_knots: int, *, bound: float = 20.0, noise: float = 0.0, rngs: nnx.Rngs):
        num_knots = require_int("num_knots", num_knots, 2, ONE_KNOT)
        self.bound = require_finite_number("bound", bound, positive=True)
        noise = require_finite_number("noise", noise, positive=False)
        self.raw_slopes = nnx.Param(plif_init(rngs.params(), num_knots, noise=noise))

    def __call__(self, z: jax.Array) -> jax.Array:
        return plif(z, self.raw_slopes[...], bound=self.bound)


class MonotoneMLP(nnx.Module):
    """Ganea's positive-weight monotone net as a module, beside :func:`bn.monotone_mlp`.

    Its hidden layer costs ``[N, M, num_hidden]`` (the reason Ganea et al. moved to PLIF); a
    head sizes its chunks for that.

    Args:
      num_hidden: ``H >= 1`` sigmoid units.
      rngs: NNX random streams (``params``).
    """

    def __init__(self, num_hidden: int, *, rngs: nnx.Rngs):
        self.num_hidden = require_int("num_hidden", num_hidden, 1)
        initial = monotone_mlp_init(rngs.params(), self.num_hidden)
        self.names = tuple(initial)
        for name, value in initial.items():
            setattr(self, name, nnx.Param(value))

    @property
    def buffers_per_logit(self) -> float:
        # Measured: 4.5 buffers per hidden unit per logit in all, the head's own 2 included.
        return 4.5 * self.num_hidden - HEAD_BUFFERS_PER_LOGIT

    def __call__(self, z: jax.Array) -> jax.Array:
        return monotone_mlp(z, {name: getattr(self, name)[...] for name in self.names})


# Logits a user's pointwise map is probed at when a head is built (check_increasing): beyond
# the range heads give, 0.5 apart, as a column [G, 1] so that a map with per-token parameters
# broadcasts to [G, M].
PROBE_LOGITS = np.linspace(-64.0, 64.0, 257, dtype=np.float32)[:, None]


def check_increasing(pointwise: Callable[[jax.Array], jax.Array]) -> None:
    """``ValueError`` if ``pointwise`` decreases between two logits of :data:`PROBE_LOGITS`.

    A head's pointwise map must be increasing: it then keeps each distribution's ranking of the
    tokens, which :func:`bottleneck.unargmaxable_tokens` and basis-aware truncation take from
    the logits ``W h + b``; a decreasing map would make their answers silently wrong. The probe
    is one call outside ``jit`` when the head is built, on 257 logits in ``[-64, 64]``: it
    catches a map that decreases anywhere there by more than 64 ulps of its largest value
    (round-off), not one that decreases only between the probes or beyond them. Nothing is
    checked where the call cannot give concrete values (the head built under ``jit`` or
    ``nnx.eval_shape``, or a map that does not take a ``[G, 1]`` float32 array), nor for
    :class:`PLIF` and :class:`MonotoneMLP`, increasing by construction.
    """
    if isinstance(pointwise, (PLIF, MonotoneMLP)):
        return  # increasing by construction (positive slopes, positive weights)
    try:
        values = pointwise(jnp.asarray(PROBE_LOGITS))
    except Exception:  # noqa: BLE001  (not callable on the probe: the head's call will tell)
        return
    if isinstance(values, jax.core.Tracer):
        return
    dtype = jnp.asarray(values).dtype
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.ndim(values) != 2:
        return
    values = np.asarray(values, np.float64)
    if values.shape[0] != PROBE_LOGITS.shape[0] or not np.isfinite(values).any():
        return
    slack = 64 * float(jnp.finfo(dtype).eps) * np.nanmax(np.abs(values[np.isfinite(values)]))
    steps = np.diff(values, axis=0)
    steps = np.where(np.isfinite(steps), steps, 0.0)  # NaN or inf: not this check's to judge
    worst = np.unravel_index(np.argmin(steps), steps.shape)
    if steps[worst] < -slack:
        low, high = PROBE_LOGITS[worst[0], 0], PROBE_LOGITS[worst[0] + 1, 0]
        raise ValueError(
            f"pointwise must be increasing (it keeps each distribution's ranking of the tokens, "
            f"which bn.unargmaxable_tokens and basis-aware truncation rely on), but "
            f"f({low:g}) = {values[worst[0], worst[1]]:.6g} > f({high:g}) = "
            f"{values[worst[0] + 1, worst[1]]:.6g}"
        )


PLIF_SLOPES_LABEL = "plif_slopes"


def param_labels(params: Any) -> Any:
    """Optax labels for a parameter pytree: ``"plif_slopes"`` for PLIF slopes, else ``"default"``.

    For ``optax.multi_transform`` so the slopes get their own learning rate (0.02 in Ganea et
    al.), e.g. ``optax.multi_transform({"default": sgd, "plif_slopes": adam}, param_labels)``.
    """

    def label(path: tuple[Any, ...], _: Any) -> str:
        names = {getattr(entry, "key", getattr(entry, "name", None)) for entry in path}
        return PLIF_SLOPES_LABEL if "raw_slopes" in names else "default"

    return jax.tree_util.tree_map_with_path(label, params)
