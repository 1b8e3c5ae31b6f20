"""``jit_model``: a test's function of an NNX model, compiled once per model graph and shapes.

``jax.jit`` of ``fn(model, ...)`` through ``nnx.split`` / ``nnx.merge``: the graph definition is
static, the parameters are traced, so models of one architecture share one compiled program.
"""

import jax
from flax import nnx


def jit_model(fn):
    compiled = jax.jit(
        lambda graphdef, state, *args: fn(nnx.merge(graphdef, state), *args), static_argnums=0
    )
    return lambda model, *args: compiled(*nnx.split(model), *args)
