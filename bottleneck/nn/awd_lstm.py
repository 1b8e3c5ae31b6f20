"""AWD-LSTM (Merity et al. 2017) with any output head, and its MoS variant (Yang et al. 2018).

Data flow of one forward pass over a window ``tokens [T, B]``::

    embedding (dropoute: whole word rows) -> locked dropout (dropouti)
    -> LSTM_1 -> locked dropout (dropouth) -> ... -> LSTM_L          (W_hh DropConnect: wdrop)
    -> locked dropout (dropout) -> head (log-probs / chunked loss; MoS latents: dropoutl)

Regularisation follows Merity et al. (2017), "Regularizing and Optimizing LSTM Language Models":

* DropConnect on the hidden-to-hidden weights (``wdrop``), one mask per forward pass;
* locked (variational) dropout: one mask per sequence, shared over time (Gal & Ghahramani);
* embedding dropout: whole rows of the embedding table (words) are dropped, the rest scaled;
* AR ``alpha * mean(h_t^2)`` on the dropped output of the last layer and TAR
  ``beta * mean((h_t - h_{t-1})^2)`` on its undropped output;
* tied input and output embeddings (Press & Wolf 2017; Inan et al. 2017).

The pure functions come first; :class:`AWDLSTM` holds the parameters and calls them. Randomness
is explicit: :meth:`AWDLSTM.dropout_masks` draws every mask of a forward pass from one ``key``,
and no masks (``key=None``) is the deterministic evaluation mode, so a training step is a pure
function of ``(params, batch, key)`` and can be replayed exactly after a restart.
The LSTM runs over time with :func:`jax.lax.scan` (with a hand-written backward pass); a window may be padded to a fixed length and
given its true ``length``, so a few compiled shapes serve AWD-LSTM's variable window lengths.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bottleneck import _blockwise_random
from bottleneck.nn.heads import OutputHead, padded_rows_init, uniform_init
from bottleneck.nn.presets import is_mixture_preset, make_head
from bottleneck.sharding import padded_vocab_size


class LSTMState(NamedTuple):
    """The recurrent state of one LSTM layer: hidden ``h`` and cell ``c``, each ``[B, H]``."""

    h: jax.Array
    c: jax.Array


Carry = tuple[LSTMState, ...]


# ----------------------------------------------------------------------------------------------
# Pure functions


def inverted_dropout_masks(
    key: jax.Array, specs: Sequence[tuple[tuple[int, ...], float]]
) -> list[jax.Array | None]:
    """Inverted-dropout masks ``Bernoulli(1 - p) / (1 - p)`` (float32) from one random draw.

    All masks of a forward pass come from a single ``uniform`` of their total size: XLA then
    compiles one random-bit generator instead of one per mask, which makes the training step
    compile about ten times faster on CPU (each threefry instance costs ~0.3 s to compile). On CPU
    that draw runs in cache-sized blocks (:mod:`bottleneck._blockwise_random`: the same numbers,
    twice as fast).

    Args:
      key: PRNG key.
      specs: ``(shape, rate)`` per mask; ``rate`` in ``[0, 1)``.

    Returns:
      One mask per spec, ``None`` where ``rate == 0``.
    """
    for shape, rate in specs:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"dropout rate must be in [0, 1), got {rate} for a mask of {shape}")
    drawn = [(shape, rate) for shape, rate in specs if rate > 0]
    total = sum(math.prod(shape) for shape, _ in drawn)
    uniform = _blockwise_random.uniform(key, total) if total else None
    masks: list[jax.Array | None] = []
    offset = 0
    for shape, rate in specs:
        if rate == 0:
            masks.append(None)
            continue
        size = math.prod(shape)
        u = uniform[offset : offset + size].reshape(shape)
        masks.append((u < 1.0 - rate).astype(jnp.float32) / (1.0 - rate))
        offset += size
    return masks


def locked_dropout(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Variational (locked) dropout: one mask per sequence and feature, shared over time.

    Args:
      x: ``[T, B, F]`` activations (time first).
      mask: ``[1, B, F]`` keep factors (0 or ``1 / (1 - p)``), broadcast over the ``T`` steps;
        ``None`` returns ``x`` (evaluation).
    """
    if jnp.ndim(x) != 3:
        raise ValueError(f"x must have shape [T, B, F], got {jnp.shape(x)}")
    if mask is None:
        return x
    if mask.shape != (1, *x.shape[1:]):
        raise ValueError(
            f"mask must have shape {(1, *x.shape[1:])} for x {x.shape}, got {mask.shape}"
        )
    return x * mask.astype(x.dtype)


def embed(table: jax.Array, tokens: jax.Array, row_mask: jax.Array | None = None) -> jax.Array:
    """Embedding lookup with embedding (word) dropout (Gal & Ghahramani 2016; Merity et al.).

    Dropping row ``w`` of the table drops word ``w`` everywhere in the batch. Equivalent to
    looking ``tokens`` up in ``table * row_mask[:, None]``, but gathers the keep factors
    instead of scaling the whole ``[M, E]`` table.

    Args:
      table: ``[M, E]`` embedding table.
      tokens: integer ids of any shape ``[...]``.
      row_mask: ``[M]`` keep factors per word (0 or ``1 / (1 - p)``); ``None``: no dropout.

    Returns:
      ``[..., E]`` embeddings.
    """
    if jnp.ndim(table) != 2:
        raise ValueError(f"table must have shape [vocab, features], got {jnp.shape(table)}")
    vectors = jnp.take(table, tokens, axis=0)
    if row_mask is None:
        return vectors
    if row_mask.shape != table.shape[:1]:
        raise ValueError(f"row_mask must have shape {table.shape[:1]}, got {row_mask.shape}")
    return vectors * jnp.take(row_mask, tokens, axis=0)[..., None].astype(vectors.dtype)


def weight_drop(w: jax.Array, mask: jax.Array | None) -> jax.Array:
    """DropConnect (Wan et al. 2013): ``w * mask`` elementwise (``None``: ``w``).

    AWD-LSTM applies it to the hidden-to-hidden weights once per forward pass, so the same
    dropped recurrent connections are used at every time step and for every sequence.
    """
    if mask is None:
        return w
    if mask.shape != w.shape:
        raise ValueError(f"mask must have the shape of w {w.shape}, got {mask.shape}")
    return w * mask.astype(w.dtype)


def lstm(
    w_ih: jax.Array,
    w_hh: jax.Array,
    bias: jax.Array,
    inputs: jax.Array,
    state: LSTMState,
    length: jax.Array | int | None = None,
    unroll: int = 1,
) -> tuple[jax.Array, LSTMState]:
    r"""One LSTM layer over time (PyTorch gate order i, f, g, o), with :func:`jax.lax.scan`.

    .. math::
       (i, f, g, o) = W_{ih} x_t + W_{hh} h_{t-1} + b, \quad
       c_t = \sigma(f) c_{t-1} + \sigma(i) \tanh(g), \quad h_t = \sigma(o) \tanh(c_t)

    The input projection ``W_ih x_t`` of all steps is one matmul outside the scan; only the
    recurrent product runs step by step. The backward pass is a custom VJP: a reverse scan of the
    gate gradients and the ``dh`` / ``dc`` recurrence, then ``dW_hh`` as one matmul over all
    steps (and ``dW_ih``, ``db``, ``dx`` by autodiff of the input projection, also one matmul
    each), equal to autodiff through the scan to float32 round-off.

    Args:
      w_ih: ``[4H, I]`` input-to-hidden weights.
      w_hh: ``[4H, H]`` hidden-to-hidden weights (already weight-dropped, if training).
      bias: ``[4H]``.
      inputs: ``[T, B, I]``.
      state: initial :class:`LSTMState`, each ``[B, H]``.
      length: steps ``t >= length`` are padding: the state is carried through them unchanged
        (their outputs are not meaningful). ``None``: all ``T`` steps are real.
      unroll: passed to :func:`jax.lax.scan`.

    Returns:
      Outputs ``h_t`` ``[T, B, H]`` and the state after step ``length - 1``.
    """
    hidden = w_hh.shape[1]
    if (
        w_hh.shape != (4 * hidden, hidden)
        or w_ih.shape[0] != 4 * hidden
        or bias.shape != (4 * hidden,)
    ):
        raise ValueError(
            f"expected w_ih [4H, I], w_hh [4H, H], bias [4H]; got {w_ih.shape}, {w_hh.shape}, "
            f"{bias.shape}"
        )
    if jnp.ndim(inputs) != 3 or inputs.shape[-1] != w_ih.shape[1]:
        raise ValueError(f"inputs must have shape [T, B, {w_ih.shape[1]}], got {inputs.shape}")
    if state.h.shape != (inputs.shape[1], hidden) or state.c.shape != state.h.shape:
        raise ValueError(
            f"state h and c must have shape [B, H] = {(inputs.shape[1], hidden)}, got "
            f"{state.h.shape} and {state.c.shape}"
        )
    input_gates = jnp.einsum("tbi,gi->tbg", inputs, w_ih) + bias
    real = None if length is None else time_mask(inputs.shape[0], length)
    outputs, h, c = _recurrence(input_gates, w_hh, state.h, state.c, real, unroll)
    return outputs, LSTMState(h, c)


def _forward_scan(
    input_gates: jax.Array,
    w_hh: jax.Array,
    h0: jax.Array,
    c0: jax.Array,
    real: jax.Array | None,
    unroll: int,
    keep_residuals: bool,
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    """The forward time loop; per step it emits ``h_t`` and, with ``keep_residuals``, the
    state's cell ``c_t`` and the activated gates (i, f, g, o after their nonlinearity)."""
    hidden = h0.shape[-1]
    w_hh_t = w_hh.T

    def step(carry, xs):
        h, c = carry
        gates_x, is_real = xs
        gates = gates_x + h @ w_hh_t
        i = jax.nn.sigmoid(gates[:, :hidden])
        f = jax.nn.sigmoid(gates[:, hidden : 2 * hidden])
        g = jnp.tanh(gates[:, 2 * hidden : 3 * hidden])
        o = jax.nn.sigmoid(gates[:, 3 * hidden :])
        new_c = f * c + i * g
        new_h = o * jnp.tanh(new_c)
        if is_real is not None:
            new_h, new_c = jnp.where(is_real, new_h, h), jnp.where(is_real, new_c, c)
        out = (new_h, new_c, jnp.concatenate([i, f, g, o], axis=-1)) if keep_residuals else new_h
        return (new_h, new_c), out

    return jax.lax.scan(step, (h0, c0), (input_gates, real), unroll=unroll)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _recurrence(
    input_gates: jax.Array,
    w_hh: jax.Array,
    h0: jax.Array,
    c0: jax.Array,
    real: jax.Array | None,
    unroll: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The time loop of :func:`lstm`: ``input_gates [T, B, 4H]`` -> outputs ``[T, B, H]``, final
    ``h`` and ``c``. ``real`` ``[T]`` (or ``None``: all real) marks the steps that update the
    state; the others carry it unchanged."""
    (h, c), outputs = _forward_scan(input_gates, w_hh, h0, c0, real, unroll, False)
    return outputs, h, c


def _recurrence_fwd(
    input_gates: jax.Array,
    w_hh: jax.Array,
    h0: jax.Array,
    c0: jax.Array,
    real: jax.Array | None,
    unroll: int,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[Any, ...]]:
    (h, c), (outputs, cells, acts) = _forward_scan(input_gates, w_hh, h0, c0, real, unroll, True)
    return (outputs, h, c), (w_hh, h0, c0, real, outputs, cells, acts)


def _recurrence_bwd(
    unroll: int, residuals: tuple[Any, ...], cotangents: tuple[jax.Array, jax.Array, jax.Array]
) -> tuple[Any, ...]:
    # The reverse loop computes only the per-step gate gradients and the dh / dc recurrence;
    # dW_hh = sum_t dgates_t^T h_{t-1} is one large matmul after it (as cuDNN and PyTorch's
    # fused LSTM do), instead of T small [4H, B] x [B, H] products accumulated into a [4H, H]
    # carry, which dominated the scan's own autodiff on CPU (the accumulator is too big for cache).
    w_hh, h0, c0, real, outputs, cells, acts = residuals
    d_outputs, d_h, d_c = cotangents
    prev_h = jnp.concatenate([h0[None], outputs[:-1]])
    prev_c = jnp.concatenate([c0[None], cells[:-1]])
    hidden = h0.shape[-1]

    def step(carry, xs):
        dh, dc = carry
        d_out, acts_t, c_t, c_prev, is_real = xs
        dh = dh + d_out
        i, f = acts_t[:, :hidden], acts_t[:, hidden : 2 * hidden]
        g, o = acts_t[:, 2 * hidden : 3 * hidden], acts_t[:, 3 * hidden :]
        tanh_c = jnp.tanh(c_t)
        dc_t = dc + dh * o * (1.0 - tanh_c * tanh_c)
        d_gates = jnp.concatenate(
            [
                dc_t * g * i * (1.0 - i),
                dc_t * c_prev * f * (1.0 - f),
                dc_t * i * (1.0 - g * g),
                dh * tanh_c * o * (1.0 - o),
            ],
            axis=-1,
        )
        # dh_{t-1} = dgates_t W_hh contracts W_hh's rows, its major dimension: the layout
        # XLA:CPU's dot (YNNPACK) runs fastest with only B rows, 1.4x the transposed one.
        dh_prev, dc_prev = d_gates @ w_hh, dc_t * f
        if is_real is not None:
            d_gates = jnp.where(is_real, d_gates, 0.0)
            dh_prev, dc_prev = jnp.where(is_real, dh_prev, dh), jnp.where(is_real, dc_prev, dc)
        return (dh_prev, dc_prev), d_gates

    (dh0, dc0), d_gates = jax.lax.scan(
        step,
        (d_h, d_c),
        (d_outputs, acts, cells, prev_c, real),
        reverse=True,
        unroll=unroll,
    )
    d_w_hh = jnp.einsum("tbg,tbh->gh", d_gates, prev_h)
    d_real = None if real is None else np.zeros(real.shape, jax.dtypes.float0)
    return d_gates, d_w_hh.astype(w_hh.dtype), dh0, dc0, d_real


_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


def time_mask(num_steps: int, length: jax.Array | int | None) -> jax.Array:
    """``[T]`` booleans, True for the real steps ``t < length`` (all True for ``None``)."""
    steps = jnp.arange(num_steps, dtype=jnp.int32)
    return jnp.ones((num_steps,), bool) if length is None else steps < length


def activation_regularization(
    dropped_output: jax.Array, alpha: float, length: jax.Array | int | None = None
) -> jax.Array:
    r"""AR (Merity et al. 2017, eq. 4): ``alpha * mean(h^2)`` over the real steps.

    Args:
      dropped_output: ``[T, B, F]`` last-layer output after its (locked) dropout.
      alpha: scale.
      length: real steps, as in :func:`lstm`.
    """
    real = time_mask(dropped_output.shape[0], length)[:, None, None]
    squares = jnp.where(real, jnp.square(dropped_output), 0.0)
    count = jnp.sum(real) * dropped_output.shape[1] * dropped_output.shape[2]
    return alpha * jnp.sum(squares) / jnp.maximum(count, 1).astype(squares.dtype)


def temporal_activation_regularization(
    output: jax.Array, beta: float, length: jax.Array | int | None = None
) -> jax.Array:
    r"""TAR (Merity et al. 2017, eq. 5): ``beta * mean((h_t - h_{t-1})^2)`` within the window.

    Args:
      output: ``[T, B, F]`` last-layer output *without* dropout.
      beta: scale.
      length: real steps; only pairs of real steps count.
    """
    real_pairs = time_mask(output.shape[0], length)[1:, None, None]
    squares = jnp.where(real_pairs, jnp.square(output[1:] - output[:-1]), 0.0)
    count = jnp.sum(real_pairs) * output.shape[1] * output.shape[2]
    return beta * jnp.sum(squares) / jnp.maximum(count, 1).astype(squares.dtype)


# ----------------------------------------------------------------------------------------------
# Modules


class LSTMLayer(nnx.Module):
    """Parameters of one LSTM layer, initialised ``U(-1/sqrt(H), 1/sqrt(H))`` as in PyTorch.

    One bias vector stands for PyTorch's two (``b_ih + b_hh``), which only ever appear summed.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        if in_features < 1 or hidden_features < 1:
            raise ValueError(
                f"in_features and hidden_features must be >= 1, got {in_features} and "
                f"{hidden_features}"
            )
        init = uniform_init(1.0 / math.sqrt(hidden_features))
        gates = 4 * hidden_features
        self.w_ih = nnx.Param(init(rngs.params(), (gates, in_features), param_dtype))
        self.w_hh = nnx.Param(init(rngs.params(), (gates, hidden_features), param_dtype))
        self.bias = nnx.Param(init(rngs.params(), (gates,), param_dtype))
        self.hidden_features = hidden_features

    def __call__(
        self,
        inputs: jax.Array,
        state: LSTMState,
        *,
        weight_mask: jax.Array | None = None,
        length: jax.Array | int | None = None,
        unroll: int = 1,
    ) -> tuple[jax.Array, LSTMState]:
        """``inputs [T, B, I]`` -> outputs ``[T, B, H]`` and final state; see :func:`lstm`.

        ``weight_mask`` ``[4H, H]`` is the DropConnect mask of ``W_hh`` (``W_ih`` is never
        dropped).
        """
        w_hh = weight_drop(self.w_hh[...], weight_mask)
        return lstm(self.w_ih[...], w_hh, self.bias[...], inputs, state, length, unroll)


class ObjectiveAux(NamedTuple):
    """What :meth:`AWDLSTM.objective` reports besides the loss (all scalars but ``carry``)."""

    nll: jax.Array
    ar: jax.Array
    tar: jax.Array
    carry: Carry


class RNNOutput(NamedTuple):
    """One forward pass of the recurrent part.

    Attributes:
      output: ``[T, B, F]`` last-layer output after the output dropout (the head's input).
      raw_output: ``[T, B, F]`` the same before that dropout (TAR's input).
      carry: the final state of every layer (for the next window).
    """

    output: jax.Array
    raw_output: jax.Array
    carry: Carry


class DropoutMasks(NamedTuple):
    """The dropout masks of one training forward pass (keep factors 0 or ``1 / (1 - p)``).

    ``None`` marks a dropout that is off. Locked masks have a time axis of 1 and broadcast over
    the window.

    Attributes:
      embedding: ``[M]`` per word (``dropoute``).
      inputs: ``[1, B, E]`` on the embeddings (``dropouti``).
      hidden: ``nlayers - 1`` masks ``[1, B, nhid]`` between layers (``dropouth``).
      weights: ``nlayers`` DropConnect masks of ``W_hh`` ``[4H_l, H_l]`` (``wdrop``).
      output: ``[1, B, nhidlast]`` on the last layer's output (``dropout``).
      latent: ``[1, B, K * emsize]`` on a mixture head's latents (``dropoutl``).
    """

    embedding: jax.Array | None
    inputs: jax.Array | None
    hidden: tuple[jax.Array | None, ...]
    weights: tuple[jax.Array | None, ...]
    output: jax.Array | None
    latent: jax.Array | None


class AWDLSTM(nnx.Module):
    """AWD-LSTM language model with any output head (Merity et al. 2017; Yang et al. 2018).

    Layer ``l`` maps ``emsize`` (first) or ``nhid`` to ``nhid``, except the last, which maps to
    ``nhidlast`` (default ``emsize`` so that a tied softmax decoder fits). The head maps
    ``nhidlast`` to log-probabilities over the ``vocab_size`` words. A mixture head ("mos",
    "moss", "mos_plif") gets ``latent_features = emsize`` so that its shared decoder can be tied
    to the embedding (Yang et al.'s MoS: nhidlast 620 -> 15 latents of 280 on PTB).

    Args:
      vocab_size: ``M``.
      emsize: embedding size ``E`` (400 in AWD-LSTM).
      nhid: hidden size of the inner layers (1150).
      nlayers: number of LSTM layers (3).
      nhidlast: output size of the last layer; default ``emsize``.
      head: a name in :data:`bottleneck.nn.HEAD_NAMES`.
      dropout: locked dropout on the last layer's output (0.4).
      dropouth: locked dropout between layers (0.25 PTB, 0.2 WT2).
      dropouti: locked dropout on the embeddings (0.4 PTB, 0.65 WT2).
      dropoute: embedding (word) dropout (0.1).
      wdrop: DropConnect on every layer's ``W_hh`` (0.5).
      dropoutl: locked dropout on a mixture head's latents (Yang et al.: 0.29); other heads
        must leave it at 0.
      tie_weights: share the embedding table with the head's decoder.
      unroll: :func:`jax.lax.scan` unroll factor of the LSTM time loop.
      rngs: NNX random streams (``params``) for the initialisation.
      head_options: passed to :func:`bottleneck.nn.make_head` (``num_components``,
        ``num_knots``, ...).

    On a mesh: build and call it inside ``with jax.set_mesh(mesh)`` for a ``("data", "vocab")``
    mesh (:func:`bottleneck.sharding.make_mesh`): the head runs data- and vocabulary-parallel
    and the tied embedding table is split by vocabulary like its decoder; shard the batch axis
    ``B`` on ``data``. The parameters start the same as without a mesh (padding rows of the
    tables are zero and never used).
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        emsize: int = 400,
        nhid: int = 1150,
        nlayers: int = 3,
        nhidlast: int | None = None,
        head: str = "softmax",
        dropout: float = 0.4,
        dropouth: float = 0.25,
        dropouti: float = 0.4,
        dropoute: float = 0.1,
        wdrop: float = 0.5,
        dropoutl: float = 0.0,
        tie_weights: bool = True,
        unroll: int = 1,
        rngs: nnx.Rngs,
        **head_options: Any,
    ):
        nhidlast = emsize if nhidlast is None else nhidlast
        for name, value in (
            ("vocab_size", vocab_size),
            ("emsize", emsize),
            ("nhid", nhid),
            ("nlayers", nlayers),
            ("nhidlast", nhidlast),
            ("unroll", unroll),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        rates = {
            "dropout": dropout,
            "dropouth": dropouth,
            "dropouti": dropouti,
            "dropoute": dropoute,
            "wdrop": wdrop,
            "dropoutl": dropoutl,
        }
        for name, rate in rates.items():
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate}")
        is_mixture = is_mixture_preset(head)
        if dropoutl > 0 and not is_mixture:
            raise ValueError(
                f"dropoutl applies to mixture heads only; got head {head!r} with "
                f"dropoutl={dropoutl}"
            )
        if tie_weights and not is_mixture and nhidlast != emsize:
            raise ValueError(
                f"tie_weights with head {head!r} needs nhidlast == emsize, got nhidlast={nhidlast} "
                f"and emsize={emsize} (mixture heads decode emsize-wide latents instead)"
            )
        self.vocab_size = vocab_size
        self.emsize, self.nhid, self.nhidlast, self.nlayers = emsize, nhid, nhidlast, nlayers
        self.dropout, self.dropouth, self.dropouti = dropout, dropouth, dropouti
        self.dropoute, self.wdrop, self.dropoutl = dropoute, wdrop, dropoutl
        self.unroll = unroll
        self.embedding = nnx.Embed(
            padded_vocab_size(vocab_size),
            emsize,
            embedding_init=padded_rows_init(uniform_init(0.1), vocab_size),
            rngs=rngs,
        )
        sizes = [emsize] + [nhid] * (nlayers - 1) + [nhidlast]
        self.layers = nnx.List(
            [LSTMLayer(sizes[i], sizes[i + 1], rngs=rngs) for i in range(nlayers)]
        )
        if is_mixture:
            head_options = {"latent_features": emsize, **head_options}
        if tie_weights:
            head_options = {"tied_embedding": self.embedding, **head_options}
        self.head: OutputHead = make_head(head, nhidlast, vocab_size, rngs=rngs, **head_options)

    def initial_carry(self, batch_size: int) -> Carry:
        """Zero state of every layer for ``batch_size`` sequences."""
        return tuple(
            LSTMState(
                jnp.zeros((batch_size, layer.hidden_features), jnp.float32),
                jnp.zeros((batch_size, layer.hidden_features), jnp.float32),
            )
            for layer in self.layers
        )

    def dropout_masks(self, key: jax.Array, batch_size: int) -> DropoutMasks:
        """Fresh :class:`DropoutMasks` for a batch of ``batch_size`` sequences."""
        layer_sizes = [layer.hidden_features for layer in self.layers]
        specs = [
            ((self.vocab_size,), self.dropoute),
            ((1, batch_size, self.emsize), self.dropouti),
            ((1, batch_size, self.nhidlast), self.dropout),
            *[((1, batch_size, size), self.dropouth) for size in layer_sizes[:-1]],
            *[((4 * size, size), self.wdrop) for size in layer_sizes],
        ]
        if self.head.is_mixture:
            specs.append(((1, batch_size, self.head.latent_mask_features), self.dropoutl))
        masks = inverted_dropout_masks(key, specs)
        rows = self.embedding.num_embeddings
        if masks[0] is not None and rows > self.vocab_size:  # a mesh's padding rows: never used
            masks[0] = jnp.pad(masks[0], (0, rows - self.vocab_size), constant_values=1.0)
        hidden = masks[3 : 3 + self.nlayers - 1]
        weights = masks[3 + self.nlayers - 1 : 3 + 2 * self.nlayers - 1]
        latent = masks[-1] if self.head.is_mixture else None
        return DropoutMasks(masks[0], masks[1], tuple(hidden), tuple(weights), masks[2], latent)

    def rnn(
        self,
        tokens: jax.Array,
        carry: Carry | None = None,
        *,
        masks: DropoutMasks | None = None,
        length: jax.Array | int | None = None,
    ) -> RNNOutput:
        """The recurrent part: ``tokens [T, B]`` -> last-layer outputs ``[T, B, nhidlast]``.

        Args:
          tokens: integer ids ``[T, B]``, time first.
          carry: state from the previous window (:meth:`initial_carry` if None).
          masks: dropout masks (:meth:`dropout_masks`); ``None`` is deterministic (evaluation).
          length: real steps of a padded window (see :func:`lstm`).
        """
        if jnp.ndim(tokens) != 2:
            raise ValueError(f"tokens must have shape [T, B], got {jnp.shape(tokens)}")
        carry = self.initial_carry(tokens.shape[1]) if carry is None else carry
        if len(carry) != self.nlayers:
            raise ValueError(f"carry must hold {self.nlayers} layer states, got {len(carry)}")
        if masks is None:
            masks = DropoutMasks(
                None, None, (None,) * (self.nlayers - 1), (None,) * self.nlayers, None, None
            )
        x = embed(self.embedding.embedding[...], tokens, masks.embedding)
        x = locked_dropout(x, masks.inputs)
        new_carry = []
        for i, layer in enumerate(self.layers):
            x, state = layer(
                x, carry[i], weight_mask=masks.weights[i], length=length, unroll=self.unroll
            )
            new_carry.append(state)
            if i < self.nlayers - 1:
                x = locked_dropout(x, masks.hidden[i])
        return RNNOutput(locked_dropout(x, masks.output), x, tuple(new_carry))

    def __call__(
        self,
        tokens: jax.Array,
        carry: Carry | None = None,
        *,
        length: jax.Array | int | None = None,
    ) -> tuple[jax.Array, Carry]:
        """Deterministic log-probabilities ``[T, B, M]`` of the next word, and the final state."""
        out = self.rnn(tokens, carry, length=length)
        return self.head(out.output), out.carry

    def nll(
        self,
        output: jax.Array,
        targets: jax.Array,
        where: jax.Array | None = None,
        latent_mask: jax.Array | None = None,
    ) -> jax.Array:
        """The head's mean NLL of ``targets [T, B]`` given the RNN's ``output [T, B, F]``.

        The head gets its tokens batch-major (``[B, T]``) so that, with the batch axis sharded
        on ``data``, each device's tokens form one contiguous block and nothing moves.

        Args:
          output: :attr:`RNNOutput.output`.
          targets: ``[T, B]`` next-token ids.
          where: optional ``[T, B]`` mask of the positions that count.
          latent_mask: a mixture head's latent dropout mask ``[1, B, K * d']``.
        """

        def batch_major(x: jax.Array | None) -> jax.Array | None:
            return None if x is None else jnp.swapaxes(x, 0, 1)

        return self.head.loss(
            batch_major(output),
            batch_major(targets),
            batch_major(where),
            latent_mask=batch_major(latent_mask),
        )

    def objective(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        carry: Carry | None = None,
        *,
        key: jax.Array | None = None,
        length: jax.Array | int | None = None,
        alpha: float = 0.0,
        beta: float = 0.0,
    ) -> tuple[jax.Array, ObjectiveAux]:
        """AWD-LSTM's training loss ``NLL + AR + TAR`` of one window (memory-bounded NLL).

        Args:
          tokens, targets: ``[T, B]`` ids; ``targets[t]`` is the word after ``tokens[t]``.
          carry: state from the previous window.
          key: PRNG key for dropout; ``None`` evaluates deterministically.
          length: real steps of a padded window; the NLL, AR and TAR count only those.
          alpha, beta: AR and TAR scales (2 and 1 in Merity et al.).

        Returns:
          The loss and :class:`ObjectiveAux` (NLL alone, AR, TAR, final carry).
        """
        if jnp.shape(targets) != jnp.shape(tokens):
            raise ValueError(
                f"targets must have the shape of tokens {jnp.shape(tokens)}, got {jnp.shape(targets)}"
            )
        masks = None if key is None else self.dropout_masks(key, tokens.shape[1])
        out = self.rnn(tokens, carry, masks=masks, length=length)
        where = None
        if length is not None:
            where = jnp.broadcast_to(time_mask(tokens.shape[0], length)[:, None], tokens.shape)
        nll = self.nll(out.output, targets, where, None if masks is None else masks.latent)
        ar = activation_regularization(out.output, alpha, length)
        tar = temporal_activation_regularization(out.raw_output, beta, length)
        return nll + ar + tar, ObjectiveAux(nll, ar, tar, out.carry)

    # Incremental decoding (:func:`bottleneck.generate`), batch-major like the Transformer's.

    def init_decode_state(self, batch_size: int, max_len: int) -> Carry:
        """The zero recurrent state; ``max_len`` is not needed (the state has a fixed size)."""
        del max_len
        return self.initial_carry(batch_size)

    def prefill(self, state: Carry, tokens: jax.Array) -> tuple[jax.Array, Carry]:
        """Feeds a prompt ``tokens [B, P]`` (no dropout): the log-probs ``[B, M]`` of the token
        after it, and the state after it."""
        if jnp.ndim(tokens) != 2:
            raise ValueError(f"tokens must have shape [B, P], got {jnp.shape(tokens)}")
        out = self.rnn(tokens.T, state)
        return self.head(out.output[-1]), out.carry

    def decode_step(self, state: Carry, tokens: jax.Array) -> tuple[jax.Array, Carry]:
        """Feeds one token per sequence, ``tokens [B]``: the next log-probs ``[B, M]``, the state."""
        if jnp.ndim(tokens) != 1:
            raise ValueError(f"tokens must have shape [B], got {jnp.shape(tokens)}")
        return self.prefill(state, tokens[:, None])


class AWDLSTMLanguageModel(nnx.Module):
    """An :class:`AWDLSTM` behind the training loop's model interface
    (:class:`bottleneck.train.lm.LanguageModel`): batch-major windows ``[B, T]``, the LSTM states
    as the carry between windows, AR / TAR in the training objective.

    Args:
      model: the AWD-LSTM (its parameters are this module's).
      alpha, beta: AR and TAR scales of the training objective (2 and 1 in Merity et al.).
    """

    def __init__(self, model: AWDLSTM, *, alpha: float = 0.0, beta: float = 0.0):
        self.model, self.alpha, self.beta = model, alpha, beta

    def initial_carry(self, batch_size: int) -> Carry:
        return self.model.initial_carry(batch_size)

    def objective(
        self, tokens: jax.Array, targets: jax.Array, carry: Carry, *, key: jax.Array, length: Any
    ) -> tuple[jax.Array, ObjectiveAux]:
        return self.model.objective(
            tokens.T, targets.T, carry, key=key, length=length, alpha=self.alpha, beta=self.beta
        )

    def nll(
        self, tokens: jax.Array, targets: jax.Array, carry: Carry, *, length: Any
    ) -> tuple[jax.Array, Carry]:
        out = self.model.rnn(tokens.T, carry, length=length)
        where = jnp.broadcast_to(time_mask(tokens.shape[1], length)[:, None], targets.T.shape)
        return self.model.nll(out.output, targets.T, where), out.carry

    def log_probs(self, tokens: jax.Array, carry: Carry, *, length: Any) -> tuple[jax.Array, Carry]:
        log_probs, carry = self.model(tokens.T, carry, length=length)
        return jnp.swapaxes(log_probs, 0, 1), carry
