r"""Singular spectra of log-probability matrices too large for an in-memory SVD (Kanai Figs 1-2).

Kanai et al. (2018, Sec. 4.3) take the ranks of :math:`\hat A`, the log-outputs of a trained
language model on a whole test set: ``[T, M]`` with ``T`` = 82,430 and ``M`` = 10,000 on PTB,
245,570 x 33,278 on WikiText-2 (they write the transpose; the rank is the same). That is 3-33 GB
in float32, so :func:`bottleneck.spectrum.singular_values` (an in-memory SVD) is out. Here the
matrix is read in row blocks ``B_b`` (from a memory-mapped ``.npy`` or a folder of ``.npy``
blocks) and only the float64 Gram matrix of the columns is kept:

.. math:: G = \hat A^\top \hat A = \sum_b B_b^\top B_b \in \mathbb{R}^{M \times M},
          \qquad \sigma_i(\hat A) = \sqrt{\lambda_i(G)}

Memory is one block plus ``G`` (``8 M^2`` bytes: 1.15 GB for ``M`` = 12,000) plus the
eigensolver's copy of it, independent of ``T``; the cost is ``T M^2`` flops for ``G`` (BLAS
``syrk``, one half of the symmetric product) and ``O(M^3)`` for the eigenvalues.

Precision. Squaring the matrix squares its condition number: an eigenvalue of ``G`` is resolved
to about ``eps64 * sigma_max^2``, so singular values are resolved down to about
``sqrt(eps64) * sigma_max ~ 1e-8 * sigma_max`` (measured: ~2e-8 on a float32 rank-37 matrix of
3000 x 1000, whose exact SVD tail sits at 2e-9). The data are float32 log-probabilities, and the
Numerical Recipes threshold with float32's eps, ``0.5 sqrt(T + M + 1) eps32 sigma_max``, is
``~4e-6 * sigma_max`` at that size and ``~2e-5 * sigma_max`` at PTB's, two to three orders of
magnitude above the Gram's floor, so the ranks are those an exact SVD would give. A float64 input
is judged with float32's eps for that reason (see :func:`rank_eps`): the Gram route cannot
resolve float64's ``eps``. Products of float32 numbers are exact in float64, so the only
rounding in ``G`` is that of the sums.

Subsampling. When ``M`` is too large for an ``M x M`` Gram, a seeded random subset of the
columns (vocabulary entries) is analysed, and ``max_tokens`` does the same for rows. Dropping
columns or rows can only lower the rank, so the rank of a subsample is a lower bound on that of
the full matrix (and for softmax, whose rank is ``d + 2``, it is unchanged as long as more than
``d + 2`` columns and rows are kept). When ``T < M`` the Gram is still ``M x M`` (``A A^T``
would need every pair of row blocks); its ``M - T`` extra eigenvalues are zero up to round-off
and are dropped, so ``min(T, M)`` singular values are returned.

This module only needs NumPy and SciPy (a JAX dependency); everything is float64 NumPy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from scipy.linalg import blas

DEFAULT_BLOCK_ROWS = 1024


# ----------------------------------------------------------------------------------------------
# Ranks from singular values


def rank_eps(dtype: np.dtype | type) -> float:
    """Machine epsilon for the rank threshold of data of ``dtype``: its eps, at least float32's.

    float16/bfloat16 data keep their (larger) eps. float64 data get float32's, because the float64
    Gram route resolves singular values only down to ``~1e-8 * sigma_max`` (module docstring).
    """
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    return float(max(np.finfo(dtype).eps, np.finfo(np.float32).eps))


def numerical_rank_tolerance(
    sigma_max: float, num_rows: int, num_columns: int, dtype: np.dtype | type = np.float32
) -> float:
    r"""The Numerical Recipes threshold of :func:`bottleneck.numerical_rank` for an ``[m, n]`` matrix.

    .. math:: \tau = \tfrac12 \sqrt{m + n + 1}\; \sigma_{\max}\; \epsilon

    with :math:`\epsilon` = :func:`rank_eps` ``(dtype)`` (Yang et al., Kanai et al.).

    Args:
      sigma_max: the largest singular value (>= 0).
      num_rows: ``m``, rows of the matrix analysed.
      num_columns: ``n``, its columns.
      dtype: the data's dtype.

    Returns:
      ``tau`` as a Python float.
    """
    if sigma_max < 0 or num_rows < 1 or num_columns < 1:
        raise ValueError(
            f"need sigma_max >= 0 and a matrix of at least 1 x 1, got sigma_max={sigma_max}, "
            f"shape [{num_rows}, {num_columns}]"
        )
    return 0.5 * math.sqrt(num_rows + num_columns + 1) * float(sigma_max) * rank_eps(dtype)


def numerical_rank_from_singular_values(
    singular_values: np.ndarray,
    num_rows: int,
    num_columns: int,
    dtype: np.dtype | type = np.float32,
    tol: float | None = None,
) -> int:
    """Count of ``singular_values > tol``; default ``tol`` = :func:`numerical_rank_tolerance`.

    Args:
      singular_values: ``[k]`` non-negative values, largest first.
      num_rows, num_columns: ``m`` and ``n`` of the matrix they come from.
      dtype: the data's dtype (for the default tolerance).
      tol: absolute threshold; ``None`` for the default.

    Raises:
      ValueError: ``singular_values`` holding NaN or inf.
    """
    s = _check_spectrum(singular_values)
    if tol is None:
        sigma_max = float(s[0]) if s.size else 0.0
        tol = numerical_rank_tolerance(sigma_max, num_rows, num_columns, dtype)
    return int(np.sum(s > tol))


def effective_rank_from_singular_values(singular_values: np.ndarray, energy: float = 0.99) -> int:
    r"""Smallest ``k`` with :math:`\sum_{i \le k} \sigma_i^2 \ge \text{energy} \sum_i \sigma_i^2`.

    Same definition as :func:`bottleneck.effective_rank` (0 for an all-zero spectrum).

    Args:
      singular_values: ``[k]`` non-negative values, largest first.
      energy: fraction in ``(0, 1]``.

    Raises:
      ValueError: ``singular_values`` holding NaN or inf.
    """
    if not 0 < energy <= 1:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    power = np.square(_check_spectrum(singular_values).astype(np.float64))
    cumulative = np.cumsum(power)
    if cumulative.size == 0 or cumulative[-1] <= 0:
        return 0
    # A few ulps of slack so that energy = 1 does not miss the last value to rounding.
    target = energy * cumulative[-1] * (1 - 4 * np.finfo(np.float64).eps)
    return int(np.sum(cumulative < target)) + 1


def _check_spectrum(singular_values: np.ndarray) -> np.ndarray:
    s = np.asarray(singular_values)
    if s.ndim != 1:
        raise ValueError(f"singular_values must have shape [k], got {s.shape}")
    # A NaN would count as no singular value (a rank of 0 or 1, a plausible number).
    if not np.all(np.isfinite(s)):
        raise ValueError(
            "singular_values must be finite (they hold NaN or inf: the matrix they come from "
            "held NaN or inf)"
        )
    return s


# ----------------------------------------------------------------------------------------------
# Streaming Gram spectrum


def gram_singular_values(
    blocks: Iterable[np.ndarray], num_columns: int, columns: np.ndarray | None = None
) -> np.ndarray:
    r"""Singular values of the row-stacked ``blocks`` from their float64 Gram matrix.

    .. math:: G = \sum_b B_b[:, c]^\top B_b[:, c], \qquad
              \sigma_i = \sqrt{\max(\lambda_i(G), 0)}

    The blocks are consumed one at a time (each may be a memory-mapped view); only ``G`` and the
    current block (as float64) are held. See the module docstring for the precision.

    Args:
      blocks: row blocks ``B_b`` of shape ``[T_b, num_columns]`` (any float dtype; rows with
        ``T_b = 0`` are allowed), conceptually concatenated along rows into ``A [T, num_columns]``.
      num_columns: ``M``, the number of columns every block must have.
      columns: optional ``[n]`` distinct column indices in ``[0, M)``; the spectrum is that of
        ``A[:, columns]``. ``None`` for all ``M`` columns.

    Returns:
      ``[min(T, n)]`` float64 singular values, largest first (``n = len(columns)`` or ``M``).
    """
    if num_columns < 1:
        raise ValueError(f"num_columns must be >= 1, got {num_columns}")
    if columns is not None:
        columns = np.asarray(columns)
        if columns.ndim != 1 or not np.issubdtype(columns.dtype, np.integer) or columns.size == 0:
            raise ValueError(f"columns must be a non-empty [n] integer array, got {columns!r}")
        if columns.min() < 0 or columns.max() >= num_columns:
            raise ValueError(f"columns must lie in [0, {num_columns}), got {columns!r}")
        if np.unique(columns).size != columns.size:
            raise ValueError("columns must be distinct")
    n = num_columns if columns is None else columns.size
    # Fortran order so that syrk accumulates in place (no n x n temporary per block).
    gram = np.zeros((n, n), dtype=np.float64, order="F")
    num_rows = 0
    for index, block in enumerate(blocks):
        block = np.asarray(block)
        if block.ndim != 2 or block.shape[1] != num_columns:
            raise ValueError(
                f"block {index} must have shape [rows, {num_columns}], got {block.shape}"
            )
        if not np.issubdtype(block.dtype, np.floating):
            raise ValueError(f"block {index} must have a floating dtype, got {block.dtype}")
        if block.shape[0] == 0:
            continue
        if columns is not None:
            block = block[:, columns]
        # B^T in Fortran order is B in C order: syrk(trans=0) on it gives B^T B without a copy.
        block_t = np.asfortranarray(block.astype(np.float64, copy=False).T)
        result = blas.dsyrk(1.0, block_t, beta=1.0, c=gram, trans=0, lower=0, overwrite_c=1)
        if result is not gram:  # Only if SciPy ever declines to write in place.
            gram = result
        num_rows += block.shape[0]
    if num_rows == 0:
        raise ValueError("blocks hold no rows")
    # Any inf or nan in A shows on the diagonal, G_jj = sum_i A_ij^2 (no n x n temporary).
    if not np.all(np.isfinite(np.diagonal(gram))):
        raise ValueError("the matrix holds non-finite values (inf or nan log-probabilities)")
    # syrk filled the upper triangle only; eigvalsh reads just that one.
    eigenvalues = np.linalg.eigvalsh(gram, UPLO="U")[::-1]
    # Round-off makes zero eigenvalues slightly negative: clip before the square root.
    return np.sqrt(np.clip(eigenvalues[: min(num_rows, n)], 0.0, None))


# ----------------------------------------------------------------------------------------------
# Log-probability files


def log_prob_files(path: str | Path) -> list[Path]:
    """The ``.npy`` files behind ``path``: the file itself, or a folder's ``*.npy`` sorted by name.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: it is neither a ``.npy`` file nor a folder holding at least one.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"log-probability path {str(path)!r} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".npy" and p.is_file())
        if not files:
            raise ValueError(f"log-probability folder {str(path)!r} holds no .npy files")
        return files
    if path.suffix != ".npy":
        raise ValueError(f"log-probability file {str(path)!r} must be a .npy file")
    return [path]


def _open(file: Path) -> np.ndarray:
    try:
        array = np.load(file, mmap_mode="r")
    except ValueError as err:  # np.load's message for a file that is not .npy / is pickled
        raise ValueError(f"cannot memory-map {str(file)!r} as a .npy array: {err}") from None
    if array.ndim != 2:
        raise ValueError(
            f"{str(file)!r} must hold a [tokens, vocab] matrix, got shape {array.shape}"
        )
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{str(file)!r} must hold floats, got dtype {array.dtype}")
    return array


@dataclasses.dataclass(frozen=True)
class LogProbSource:
    """The shape of the log-probability matrix behind a path (headers only, nothing read).

    Attributes:
      files: the ``.npy`` files in row order.
      block_rows: ``[F]`` rows of each file.
      num_rows: ``T``, their sum.
      num_columns: ``M``, shared by every file.
      dtype: the files' dtype (the widest one if they differ).
    """

    files: tuple[Path, ...]
    block_rows: tuple[int, ...]
    num_rows: int
    num_columns: int
    dtype: np.dtype


def open_log_probs(path: str | Path) -> LogProbSource:
    """Check the ``.npy`` file or folder of blocks at ``path`` and return its shape.

    Raises:
      FileNotFoundError, ValueError: as :func:`log_prob_files`, or if a file is not a 2-D float
        ``.npy`` array, the blocks disagree on the number of columns, or there are no rows.
    """
    files = log_prob_files(path)
    arrays = [_open(file) for file in files]
    widths = {array.shape[1] for array in arrays}
    if len(widths) != 1:
        shapes = ", ".join(f"{f.name}: {a.shape}" for f, a in zip(files, arrays, strict=True))
        raise ValueError(
            f"the blocks under {str(path)!r} disagree on the vocabulary size: {shapes}"
        )
    rows = tuple(int(array.shape[0]) for array in arrays)
    if sum(rows) == 0:
        raise ValueError(f"the log-probabilities at {str(path)!r} hold no rows")
    dtype = max((array.dtype for array in arrays), key=lambda dt: dt.itemsize)
    return LogProbSource(tuple(files), rows, sum(rows), widths.pop(), np.dtype(dtype))


def iter_log_prob_blocks(
    path: str | Path, block_rows: int = DEFAULT_BLOCK_ROWS, rows: np.ndarray | None = None
) -> Iterator[np.ndarray]:
    """Yield the log-probability matrix at ``path`` in row blocks, in order.

    A ``.npy`` file ``[T, M]`` is memory-mapped; a folder's ``.npy`` blocks ``[T_i, M]`` (sorted
    by name) are read one after the other, as if concatenated along rows. No block crosses a
    file boundary, so blocks may be shorter than ``block_rows``.

    Args:
      path: a ``.npy`` file or a folder of them.
      block_rows: at most this many rows per yielded block.
      rows: optional sorted ``[k]`` global row indices in ``[0, T)`` to keep (a row subsample);
        ``None`` for every row.

    Yields:
      ``[<= block_rows, M]`` arrays in the files' dtype (read-only memory-mapped views when
      ``rows`` is ``None``, copies otherwise).
    """
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    source = open_log_probs(path)
    if rows is not None:
        rows = np.asarray(rows)
        if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
            raise ValueError(f"rows must be a [k] integer array, got {rows!r}")
        if rows.size and (rows.min() < 0 or rows.max() >= source.num_rows):
            raise ValueError(f"rows must lie in [0, {source.num_rows})")
        if np.any(np.diff(rows) <= 0):
            raise ValueError("rows must be sorted and distinct")
    offset = 0
    for file, length in zip(source.files, source.block_rows, strict=True):
        array = _open(file)
        if rows is None:
            for start in range(0, length, block_rows):
                yield array[start : start + block_rows]
        else:
            lo, hi = np.searchsorted(rows, [offset, offset + length])
            local = rows[lo:hi] - offset
            for start in range(0, local.size, block_rows):
                yield array[local[start : start + block_rows]]
        offset += length


def _num_blocks(source: LogProbSource, rows: np.ndarray | None, block_rows: int) -> int:
    """How many blocks :func:`iter_log_prob_blocks` yields (for a progress bar)."""
    bounds = np.cumsum((0, *source.block_rows))
    if rows is None:
        kept = np.diff(bounds)
    else:
        kept = np.diff(np.searchsorted(rows, bounds))
    return int(sum(math.ceil(k / block_rows) for k in kept))


def sample_indices(total: int, keep: int | None, seed: int) -> np.ndarray | None:
    """A sorted, seeded random subset of ``keep`` of ``range(total)``; ``None`` keeps everything.

    ``None`` is returned when ``keep`` is ``None`` or ``>= total``, so "no subsampling" is
    explicit. The same ``(total, keep, seed)`` always gives the same subset.
    """
    if keep is None or keep >= total:
        return None
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    chosen = np.random.default_rng(seed).choice(total, size=keep, replace=False)
    return np.sort(chosen).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class StreamingSpectrum:
    """Spectrum of (a subsample of) a log-probability matrix on disk.

    Attributes:
      singular_values: ``[min(num_rows, num_columns)]`` float64, largest first.
      num_rows: ``m``, rows analysed (tokens).
      num_columns: ``n``, columns analysed (vocabulary entries).
      total_rows: ``T`` of the whole matrix.
      total_columns: ``M`` of the whole matrix.
      rows: sorted row indices analysed, or ``None`` for all.
      columns: sorted column indices analysed, or ``None`` for all.
      dtype: the data's dtype.
    """

    singular_values: np.ndarray
    num_rows: int
    num_columns: int
    total_rows: int
    total_columns: int
    rows: np.ndarray | None
    columns: np.ndarray | None
    dtype: np.dtype

    def tolerance(self) -> float:
        """:func:`numerical_rank_tolerance` for the analysed ``[num_rows, num_columns]`` matrix."""
        sigma_max = float(self.singular_values[0]) if self.singular_values.size else 0.0
        return numerical_rank_tolerance(sigma_max, self.num_rows, self.num_columns, self.dtype)

    def numerical_rank(self) -> int:
        """Count of singular values above :meth:`tolerance`."""
        return int(np.sum(self.singular_values > self.tolerance()))

    def effective_rank(self, energy: float = 0.99) -> int:
        """:func:`effective_rank_from_singular_values` of the spectrum."""
        return effective_rank_from_singular_values(self.singular_values, energy)


def log_prob_spectrum(
    path: str | Path,
    *,
    max_vocab: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    progress: bool = False,
) -> StreamingSpectrum:
    """Stream the log-probabilities at ``path`` once and return their singular spectrum.

    Args:
      path: a ``.npy`` file ``[T, M]`` or a folder of ``.npy`` blocks ``[T_i, M]``.
      max_vocab: analyse at most this many columns: a seeded random subset when ``M`` is larger
        (bounds the ``M x M`` Gram). ``None`` for all.
      max_tokens: analyse at most this many rows, likewise. ``None`` for all.
      seed: seed of both subsets (columns from ``seed``, rows from ``seed + 1``).
      block_rows: rows read at a time.
      progress: show a tqdm bar over the blocks (stderr).

    Returns:
      A :class:`StreamingSpectrum`.
    """
    source = open_log_probs(path)
    columns = sample_indices(source.num_columns, max_vocab, seed)
    rows = sample_indices(source.num_rows, max_tokens, seed + 1)
    blocks: Iterable[np.ndarray] = iter_log_prob_blocks(path, block_rows, rows)
    num_rows = source.num_rows if rows is None else rows.size
    if progress:
        from tqdm.auto import tqdm

        blocks = tqdm(blocks, total=_num_blocks(source, rows, block_rows), desc="Gram", leave=False)
    values = gram_singular_values(blocks, source.num_columns, columns)
    return StreamingSpectrum(
        singular_values=values,
        num_rows=num_rows,
        num_columns=source.num_columns if columns is None else columns.size,
        total_rows=source.num_rows,
        total_columns=source.num_columns,
        rows=rows,
        columns=columns,
        dtype=source.dtype,
    )
