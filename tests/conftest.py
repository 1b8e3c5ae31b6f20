"""Test-wide JAX settings: strict dtype promotion catches silent up/down-casts (as equinox does)."""

import os

# LAPACK (SVD) runs on OpenBLAS threads that fight XLA's own on small CPUs: 10-200x slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
