"""bottleneck.spectrum_streaming: the streamed Gram spectrum equals an in-memory SVD."""

import numpy as np
import pytest

import bottleneck as bn
from bottleneck import spectrum_streaming as ss

EPS32 = float(np.finfo(np.float32).eps)


def low_rank(rows: int, cols: int, rank: int, seed: int = 0) -> np.ndarray:
    """A float32 ``[rows, cols]`` matrix of exact rank ``rank`` (before the float32 cast)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols))).astype(
        np.float32
    )


def svd(a: np.ndarray) -> np.ndarray:
    return np.linalg.svd(np.asarray(a, np.float64), compute_uv=False)


def split_rows(a: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(a, np.cumsum(sizes)[:-1])


@pytest.mark.parametrize("shape", [(200, 60), (40, 90)], ids=["tall", "wide"])
def test_gram_spectrum_equals_svd(shape):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(shape) - 5.0).astype(np.float32)  # log-prob-like offset
    # Uneven blocks, an empty one included.
    sizes = [7, 0, shape[0] - 7 - 13, 13]
    values = ss.gram_singular_values(split_rows(a, sizes), shape[1])
    expected = svd(a)
    assert values.dtype == np.float64 and values.shape == (min(shape),)
    assert np.all(np.diff(values) <= 0)
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6 * expected[0])


def test_gram_spectrum_of_a_column_subset():
    a = np.random.default_rng(2).standard_normal((150, 80)).astype(np.float32)
    columns = np.array([3, 10, 11, 40, 79])
    values = ss.gram_singular_values(split_rows(a, [50, 100]), 80, columns)
    expected = svd(a[:, columns])
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6 * expected[0])


def test_rank_of_a_low_rank_matrix_matches_numerical_rank():
    a = low_rank(300, 120, rank=17)
    values = ss.gram_singular_values([a[:100], a[100:]], 120)
    rank = ss.numerical_rank_from_singular_values(values, 300, 120, np.float32)
    assert rank == 17 == int(bn.numerical_rank(a))
    # The tail (the float32 entries' round-off, resolved by the float64 Gram) is well below it.
    tol = ss.numerical_rank_tolerance(values[0], 300, 120)
    assert values[17] < 0.1 * tol < values[16]


def test_tolerance_and_effective_rank_match_bottleneck():
    a = np.random.default_rng(3).standard_normal((30, 20)).astype(np.float32)
    values = svd(a)
    np.testing.assert_allclose(
        ss.numerical_rank_tolerance(values[0], 30, 20), 0.5 * np.sqrt(51) * values[0] * EPS32
    )
    for energy in (0.5, 0.9, 0.99, 1.0):
        assert ss.effective_rank_from_singular_values(values, energy) == int(
            bn.effective_rank(a, energy)
        )
    assert ss.effective_rank_from_singular_values(np.zeros(4)) == 0
    assert ss.numerical_rank_from_singular_values(values, 30, 20, tol=values[3]) == 3


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_ranks_of_non_finite_singular_values_are_refused(bad):
    values = np.array([3.0, bad, 1.0])
    with pytest.raises(ValueError, match="singular_values must be finite"):
        ss.numerical_rank_from_singular_values(values, 3, 3)
    with pytest.raises(ValueError, match="singular_values must be finite"):
        ss.effective_rank_from_singular_values(values)


def test_rank_eps():
    assert ss.rank_eps(np.float32) == EPS32
    assert ss.rank_eps(np.float64) == EPS32  # the Gram cannot resolve float64's eps
    assert ss.rank_eps(np.float16) == float(np.finfo(np.float16).eps)
    with pytest.raises(ValueError, match="floating"):
        ss.rank_eps(np.int32)


def test_gram_rejects_bad_input():
    with pytest.raises(ValueError, match=r"block 1 must have shape \[rows, 4\]"):
        ss.gram_singular_values([np.zeros((2, 4)), np.zeros((2, 5))], 4)
    with pytest.raises(ValueError, match="no rows"):
        ss.gram_singular_values([], 4)
    with pytest.raises(ValueError, match="non-finite"):
        ss.gram_singular_values([np.array([[0.0, -np.inf]])], 2)
    with pytest.raises(ValueError, match="columns must lie"):
        ss.gram_singular_values([np.zeros((2, 4))], 4, np.array([0, 4]))
    with pytest.raises(ValueError, match="distinct"):
        ss.gram_singular_values([np.zeros((2, 4))], 4, np.array([1, 1]))


@pytest.fixture
def stored(tmp_path):
    """The same [70, 30] matrix as one .npy and as a folder of three blocks."""
    a = np.random.default_rng(4).standard_normal((70, 30)).astype(np.float32)
    np.save(tmp_path / "all.npy", a)
    folder = tmp_path / "blocks"
    folder.mkdir()
    # Names sort in row order; a non-.npy file is ignored.
    for name, part in zip(["b0.npy", "b1.npy", "b2.npy"], split_rows(a, [25, 40, 5]), strict=True):
        np.save(folder / name, part)
    (folder / "README.txt").write_text("not a block")
    return a, tmp_path / "all.npy", folder


def test_iter_blocks_reads_file_and_folder_in_order(stored):
    a, file, folder = stored
    for path in (file, folder):
        blocks = list(ss.iter_log_prob_blocks(path, block_rows=16))
        assert all(b.shape[0] <= 16 and b.shape[1] == 30 for b in blocks)
        np.testing.assert_array_equal(np.concatenate(blocks), a)
    rows = np.array([0, 3, 24, 25, 26, 64, 65, 69])  # across all three blocks
    picked = np.concatenate(list(ss.iter_log_prob_blocks(folder, block_rows=2, rows=rows)))
    np.testing.assert_array_equal(picked, a[rows])
    source = ss.open_log_probs(folder)
    assert (source.num_rows, source.num_columns, source.block_rows) == (70, 30, (25, 40, 5))
    assert ss._num_blocks(source, rows, 2) == len(
        list(ss.iter_log_prob_blocks(folder, block_rows=2, rows=rows))
    )


def test_log_prob_spectrum_subsamples_reproducibly(stored):
    a, file, folder = stored
    full = ss.log_prob_spectrum(folder, block_rows=8)
    np.testing.assert_allclose(full.singular_values, svd(a), atol=1e-6 * svd(a)[0])
    assert full.columns is None and full.rows is None
    sub = ss.log_prob_spectrum(file, max_vocab=12, max_tokens=50, seed=5)
    again = ss.log_prob_spectrum(folder, max_vocab=12, max_tokens=50, seed=5, block_rows=7)
    np.testing.assert_array_equal(sub.columns, again.columns)
    np.testing.assert_array_equal(sub.rows, again.rows)
    np.testing.assert_allclose(sub.singular_values, again.singular_values, rtol=1e-10)
    expected = svd(a[np.ix_(sub.rows, sub.columns)])
    np.testing.assert_allclose(sub.singular_values, expected, atol=1e-6 * expected[0])
    assert (sub.num_rows, sub.num_columns, sub.total_rows, sub.total_columns) == (50, 12, 70, 30)
    other = ss.log_prob_spectrum(file, max_vocab=12, seed=6)
    assert not np.array_equal(other.columns, sub.columns)


def test_sample_indices():
    chosen = ss.sample_indices(100, 10, seed=0)
    assert chosen.shape == (10,) and np.all(np.diff(chosen) > 0) and chosen.max() < 100
    np.testing.assert_array_equal(chosen, ss.sample_indices(100, 10, seed=0))
    assert ss.sample_indices(100, None, 0) is None and ss.sample_indices(100, 100, 0) is None


def test_open_log_probs_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ss.open_log_probs(tmp_path / "missing.npy")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .npy files"):
        ss.open_log_probs(tmp_path / "empty")
    np.save(tmp_path / "vector.npy", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"\[tokens, vocab\] matrix"):
        ss.open_log_probs(tmp_path / "vector.npy")
    (tmp_path / "text.txt").write_text("x")
    with pytest.raises(ValueError, match="must be a .npy file"):
        ss.open_log_probs(tmp_path / "text.txt")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    np.save(mixed / "a.npy", np.zeros((2, 3), np.float32))
    np.save(mixed / "b.npy", np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="disagree on the vocabulary size"):
        ss.open_log_probs(mixed)
