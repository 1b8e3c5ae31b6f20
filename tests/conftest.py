"""Test-wide JAX settings: strict dtype promotion catches silent up/down-casts (as equinox does)."""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
