r"""Orhan's mixture-of-experts dense layer: a gated sum of ``K`` dense expert layers.

Orhan ("The softmax bottleneck is a special case of a more general phenomenon", 2018) shows that a
single dense ReLU layer has a degenerate input-output Jacobian (about half of its singular values
are ~0, one per saturated unit) and that summing ``K`` such experts breaks the degeneracy, even
with constant gates. Yang et al.'s mixture of softmaxes is the special case with softmax experts
and softmax gates. See ``experiments/jacobian.py`` for the analysis.

.. math::

    y(x) = \sum_{k=1}^{K} g_k(x)\, \phi\!\left(x W_k + c_k\right), \qquad
    g(x) = \gamma\!\left(x V + b\right) \in \mathbb{R}^K

with expert activation :math:`\phi` (ReLU by default) and gate activation :math:`\gamma` over the
expert axis (softmax by default); constant gates use :math:`g_k = 1/K` and have no parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from bottleneck._checks import compute_dtype, require_float, require_ndim

Activation = Callable[[jax.Array], jax.Array]

# Default initialisers. The expert axis of the [K, in, out] kernels is a batch axis, so each expert
# gets its own Glorot-uniform [in, out] kernel (as K separate dense layers would) rather than one
# with fans inflated by K.
default_kernel_init = nnx.initializers.glorot_uniform(batch_axis=0)
default_gate_kernel_init = nnx.initializers.glorot_uniform()
default_bias_init = nnx.initializers.zeros_init()


def dense_moe(
    x: jax.Array,
    expert_kernels: jax.Array,
    expert_biases: jax.Array | None = None,
    gate_kernel: jax.Array | None = None,
    gate_bias: jax.Array | None = None,
    *,
    expert_activation: Activation = jax.nn.relu,
    gate_activation: Activation = jax.nn.softmax,
) -> jax.Array:
    r"""Mixture-of-experts dense layer (Orhan 2018), as a pure function.

    .. math::

        y = \sum_{k=1}^{K} g_k\, \phi(x W_k + c_k), \qquad
        g = \gamma(x V + b) \quad\text{or}\quad g_k = 1/K \text{ without a gate kernel}

    Args:
      x: ``[..., in]`` inputs.
      expert_kernels: ``[K, in, out]`` expert weights :math:`W_k`.
      expert_biases: ``[K, out]`` expert biases :math:`c_k`, or ``None`` for none.
      gate_kernel: ``[in, K]`` gate weights :math:`V`, or ``None`` for constant gates
        :math:`g_k = 1/K` (Orhan's ablation).
      gate_bias: ``[K]`` gate bias :math:`b`, or ``None``; requires ``gate_kernel``.
      expert_activation: :math:`\phi`, applied elementwise to ``[..., K, out]``.
      gate_activation: :math:`\gamma`, applied to the ``[..., K]`` gate logits; it must act over
        the last axis (as ``jax.nn.softmax`` does by default) and keep the shape.

    Returns:
      ``[..., out]`` outputs, dtype float32 (float64 if any input is float64).

    Example:
      >>> import jax.numpy as jnp
      >>> from bottleneck.nn.moe import dense_moe
      >>> x = jnp.ones((5, 3))
      >>> dense_moe(x, jnp.ones((4, 3, 2)), gate_kernel=jnp.zeros((3, 4))).shape
      (5, 2)
    """
    _check_dense_moe_args(x, expert_kernels, expert_biases, gate_kernel, gate_bias)
    arrays = [
        a for a in (x, expert_kernels, expert_biases, gate_kernel, gate_bias) if a is not None
    ]
    # Cast everything to one dtype by hand: implicit promotion is an error under strict mode.
    dtype = compute_dtype(*arrays)
    x = jnp.asarray(x).astype(dtype)

    # [..., in] x [K, in, out] -> [..., K, out]: all experts in one contraction.
    expert_outputs = jnp.einsum("...i,kio->...ko", x, jnp.asarray(expert_kernels).astype(dtype))
    if expert_biases is not None:
        expert_outputs = expert_outputs + jnp.asarray(expert_biases).astype(dtype)
    expert_outputs = expert_activation(expert_outputs)

    if gate_kernel is None:
        # Constant gates 1/K: the plain average of the experts.
        return jnp.mean(expert_outputs, axis=-2)

    gate_logits = x @ jnp.asarray(gate_kernel).astype(dtype)
    if gate_bias is not None:
        gate_logits = gate_logits + jnp.asarray(gate_bias).astype(dtype)
    gates = gate_activation(gate_logits)
    if jnp.shape(gates) != jnp.shape(gate_logits):
        raise ValueError(
            f"gate_activation must keep the gate logits' shape [..., K] = {jnp.shape(gate_logits)}, "
            f"got {jnp.shape(gates)}"
        )
    return jnp.einsum("...k,...ko->...o", gates.astype(dtype), expert_outputs.astype(dtype))


def _check_dense_moe_args(
    x: jax.Array,
    expert_kernels: jax.Array,
    expert_biases: jax.Array | None,
    gate_kernel: jax.Array | None,
    gate_bias: jax.Array | None,
) -> None:
    """Raise ``ValueError`` naming the argument whose shape or dtype does not fit ``dense_moe``."""
    require_float("x", x)
    require_float("expert_kernels", expert_kernels)
    require_ndim("x", x, 1, "[..., in_features]")
    if jnp.ndim(expert_kernels) != 3:
        raise ValueError(
            f"expert_kernels must have shape [K, in_features, out_features], "
            f"got shape {jnp.shape(expert_kernels)}"
        )
    num_experts, in_features, out_features = jnp.shape(expert_kernels)
    if num_experts < 1:
        raise ValueError(
            f"expert_kernels must hold at least one expert (K >= 1), got shape {jnp.shape(expert_kernels)}"
        )
    if jnp.shape(x)[-1] != in_features:
        raise ValueError(
            f"x must have shape [..., in_features] with in_features = {in_features} (from "
            f"expert_kernels {jnp.shape(expert_kernels)}), got shape {jnp.shape(x)}"
        )
    expected = {
        "expert_biases": (expert_biases, (num_experts, out_features), "[K, out_features]"),
        "gate_kernel": (gate_kernel, (in_features, num_experts), "[in_features, K]"),
        "gate_bias": (gate_bias, (num_experts,), "[K]"),
    }
    for name, (array, shape, shape_doc) in expected.items():
        if array is None:
            continue
        require_float(name, array)
        if jnp.shape(array) != shape:
            raise ValueError(
                f"{name} must have shape {shape_doc} = {shape}, got shape {jnp.shape(array)}"
            )
    if gate_bias is not None and gate_kernel is None:
        raise ValueError("gate_bias requires gate_kernel (constant gates have no parameters)")


class DenseMoE(nnx.Module):
    r"""Orhan's mixture-of-experts dense layer: ``[..., in_features] -> [..., out_features]``.

    .. math:: y = \sum_{k=1}^{K} g_k(x)\, \phi(x W_k + c_k), \qquad g(x) = \gamma(x V + b)

    A port of Orhan's Keras ``DenseMoE`` layer (see the note "The softmax bottleneck is a special
    case of a more general phenomenon"); the maths lives in :func:`dense_moe`.

    Args:
      in_features: input size ``in``.
      out_features: output size ``out`` (per expert and of the mixture).
      num_experts: ``K >= 1``; ``K = 1`` with constant gates is a plain dense layer
        :math:`\phi(x W + c)`.
      rngs: randomness for the initialisers (``params`` stream).
      expert_activation: :math:`\phi`, elementwise.
      gate_activation: :math:`\gamma`, over the last (expert) axis of ``[..., K]``.
      constant_gates: use :math:`g_k = 1/K` (no gate parameters), Orhan's ablation.
      use_bias: add the expert biases :math:`c_k` and the gate bias :math:`b` (zero-initialised).
      kernel_init: initialiser of the ``[K, in, out]`` expert kernels; the default is Glorot
        uniform for each expert separately (the expert axis is a batch axis, not a fan).
      gate_kernel_init: initialiser of the ``[in, K]`` gate kernel (Glorot uniform).
      bias_init: initialiser of the biases (zeros).
      param_dtype: dtype of the parameters.

    Attributes:
      expert_kernels: ``nnx.Param [K, in, out]``.
      expert_biases: ``nnx.Param [K, out]`` or ``None``.
      gate_kernel: ``nnx.Param [in, K]`` or ``None`` (constant gates).
      gate_bias: ``nnx.Param [K]`` or ``None``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from bottleneck.nn.moe import DenseMoE
      >>> layer = DenseMoE(3, 2, num_experts=4, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((5, 3))).shape
      (5, 2)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_experts: int,
        *,
        rngs: nnx.Rngs,
        expert_activation: Activation = jax.nn.relu,
        gate_activation: Activation = jax.nn.softmax,
        constant_gates: bool = False,
        use_bias: bool = True,
        kernel_init: nnx.Initializer = default_kernel_init,
        gate_kernel_init: nnx.Initializer = default_gate_kernel_init,
        bias_init: nnx.Initializer = default_bias_init,
        param_dtype: jnp.dtype = jnp.float32,
    ) -> None:
        for name, value in [
            ("in_features", in_features),
            ("out_features", out_features),
            ("num_experts", num_experts),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.in_features = in_features
        self.out_features = out_features
        self.num_experts = num_experts
        self.expert_activation = expert_activation
        self.gate_activation = gate_activation
        self.constant_gates = constant_gates

        shape = (num_experts, in_features, out_features)
        self.expert_kernels = nnx.Param(kernel_init(rngs.params(), shape, param_dtype))
        self.expert_biases = (
            nnx.Param(bias_init(rngs.params(), (num_experts, out_features), param_dtype))
            if use_bias
            else None
        )
        if constant_gates:
            self.gate_kernel = None
            self.gate_bias = None
        else:
            self.gate_kernel = nnx.Param(
                gate_kernel_init(rngs.params(), (in_features, num_experts), param_dtype)
            )
            self.gate_bias = (
                nnx.Param(bias_init(rngs.params(), (num_experts,), param_dtype))
                if use_bias
                else None
            )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., in_features]`` inputs -> ``[..., out_features]`` mixture outputs."""
        if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != self.in_features:
            raise ValueError(
                f"x must have shape [..., in_features] with in_features = {self.in_features}, "
                f"got shape {jnp.shape(x)}"
            )
        return dense_moe(
            x,
            self.expert_kernels[...],
            None if self.expert_biases is None else self.expert_biases[...],
            None if self.gate_kernel is None else self.gate_kernel[...],
            None if self.gate_bias is None else self.gate_bias[...],
            expert_activation=self.expert_activation,
            gate_activation=self.gate_activation,
        )
