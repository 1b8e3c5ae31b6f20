"""The blockwise dropout draw equals ``jax.random.uniform`` bit for bit, wherever it applies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bottleneck import _blockwise_random
from bottleneck._blockwise_random import BLOCK, uniform


@pytest.mark.parametrize(
    "num",
    [BLOCK + 1, 2 * BLOCK, 3 * BLOCK - 7, 5 * BLOCK + 12345],
    ids=lambda n: f"num={n}",
)
def test_equals_jax_uniform_bit_for_bit(num):
    key = jax.random.key(7)
    got = jax.jit(uniform, static_argnums=1)(key, num)
    want = jax.random.uniform(key, (num,), jnp.float32)
    assert got.dtype == jnp.float32 and got.shape == (num,)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


def test_takes_the_blocks_on_cpu():
    key, num = jax.random.key(0), 3 * BLOCK
    assert _blockwise_random._is_blockwise(key, num)
    hlo = jax.jit(uniform, static_argnums=1).lower(key, num).as_text()
    assert f"tensor<3x{BLOCK}xf32>" in hlo  # the blocks' stacked draws
    unblocked = jax.jit(lambda k: jax.random.uniform(k, (num,))).lower(key).as_text()
    assert f"tensor<3x{BLOCK}xf32>" not in unblocked


@pytest.mark.parametrize(
    "key, num",
    [
        (jax.random.key(1), BLOCK),  # one block: nothing to gain
        (jax.random.key(1, impl="rbg"), 3 * BLOCK),  # another PRNG
        (jax.random.PRNGKey(1), 3 * BLOCK),  # a raw uint32 key
    ],
    ids=["one-block", "rbg", "raw-key"],
)
def test_other_keys_and_small_draws_fall_back_to_jax(key, num):
    assert not _blockwise_random._is_blockwise(key, num)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(uniform, static_argnums=1)(key, num)),
        np.asarray(jax.random.uniform(key, (num,), jnp.float32)),
    )


def test_vmapped_over_keys():
    keys = jax.random.split(jax.random.key(3), 2)
    got = jax.jit(jax.vmap(lambda k: uniform(k, 2 * BLOCK + 5)))(keys)
    want = jax.vmap(lambda k: jax.random.uniform(k, (2 * BLOCK + 5,)))(keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_original_threefry_layout_falls_back_to_jax():
    # Without jax_threefry_partitionable, element i is no longer a function of i alone.
    key, num = jax.random.key(2), 3 * BLOCK
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        assert not _blockwise_random._is_blockwise(key, num)
        got = jax.jit(uniform, static_argnums=1)(key, num)
        want = jax.random.uniform(key, (num,), jnp.float32)
    finally:
        jax.config.update("jax_threefry_partitionable", before)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
