"""bn.bat_keep_mask (basis-aware truncation) against an independent linear program, a case solved
by hand and the threshold rule it reduces to; bn.generate's bat_tau option."""

import signal
import threading
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from flax import nnx
from scipy.optimize import linprog

import bottleneck as bn
from bottleneck import truncation
from bottleneck.nn import AWDLSTM, Transformer


def min_probability(p, W, tau, i):
    """min p_i over {W^T p = W^T p_hat, sum p = 1, 0 <= p <= p_hat / (1 - tau)} (interior point)."""
    M = len(p)
    cost = np.zeros(M)
    cost[i] = 1.0
    result = linprog(
        cost, A_eq=np.vstack([W.T, np.ones(M)]), b_eq=np.r_[W.T @ p, 1.0],
        bounds=np.c_[np.zeros(M), p / (1 - tau)], method="highs-ipm",
    )  # fmt: skip
    assert result.status == 0
    return result.fun


def test_a_case_solved_by_hand_keeps_a_token_below_the_threshold():
    # W = [1, 0, -1]: the moments fix p_0 - p_2 = 0.3; zeroing token 1 needs p = (0.65, 0, 0.35).
    W = np.array([[1.0], [0.0], [-1.0]])
    log_p = np.log([0.6, 0.1, 0.3])
    # cap on p_2 = 0.3 / (1 - tau): 0.341 < 0.35 at tau = 0.12 (kept although 0.1 < tau) ...
    assert bn.bat_keep_mask(log_p, W, tau=0.12).tolist() == [True, True, True]
    # ... 0.375 >= 0.35 at tau = 0.2: p = (0.65, 0, 0.35) is consistent, token 1 goes.
    assert bn.bat_keep_mask(log_p, W, tau=0.2).tolist() == [True, False, True]
    assert bn.bat_keep_mask(log_p, W, tau=0.2, tokens=[1, 1]).tolist() == [False, False]


@pytest.mark.parametrize("seed", range(4))
def test_never_keeps_a_token_that_can_be_zero_nor_drops_one_that_cannot(seed):
    rng = np.random.default_rng(seed)
    M, d, tau = 12, 2, 0.08
    W = rng.normal(size=(M, d))
    logits = W @ rng.normal(size=d) + rng.normal(size=M)
    log_p = logits - np.log(np.exp(logits).sum())
    keep = bn.bat_keep_mask(log_p, W, tau=tau)
    p = np.exp(log_p) / np.exp(log_p).sum()
    least = np.array([min_probability(p, W, tau, i) for i in range(M)])
    assert np.all(least[~keep] < 1e-9)  # dropped: a consistent distribution gives it zero
    assert np.all(least[keep] > 1e-9)  # kept: none does
    assert np.all(keep[p >= tau]) and not keep.all() and keep[p < tau].any()


def test_zero_decoder_is_the_threshold_rule_and_every_token_above_tau_stays():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(30))
    for tau in (0.01, 0.03, 0.1):
        keep = bn.bat_keep_mask(np.log(p), np.zeros((30, 4)), tau=tau)
        np.testing.assert_array_equal(keep, p >= tau)
    W = rng.normal(size=(30, 4))
    assert bn.bat_keep_mask(np.log(p), W, tau=p.min()).all()  # every token passes: no truncation


@pytest.mark.parametrize("seed", range(3))
def test_the_primal_certificate_discards_only_tokens_a_consistent_law_can_zero(seed):
    """Where moving token i's mass by least squares keeps every bound, the independent program
    confirms that p_i can be 0; on these wide vocabularies it decides most of the discards, so
    that few tokens need a program of their own."""
    rng = np.random.default_rng(seed)
    M, d, tau = 300, 4, 0.02
    W = rng.normal(size=(M, d))
    logits = W @ rng.normal(size=d) + 0.5 * rng.normal(size=M)
    log_p = logits - np.log(np.exp(logits).sum())
    problem = truncation.BatProblem(log_p, W, tau)
    p = problem.p
    below = np.flatnonzero(p < tau)
    certified = [i for i in below if problem._moved_mass_fits(int(i))]
    assert len(certified) > len(below) // 2
    for i in certified[:: max(1, len(certified) // 12)]:
        assert min_probability(p, W, tau, i) < 1e-9
    keep = np.array([problem.keep(int(i)) for i in range(M)])
    assert problem.programs < len(below) - len(certified) + 1  # only the undecided ones
    np.testing.assert_array_equal(keep, bn.bat_keep_mask(log_p, W, tau=tau))


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals need the main thread"
)
def test_ctrl_c_interrupts_a_long_program(monkeypatch):
    """A program that would run for a minute: SIGINT raises KeyboardInterrupt within a second."""
    slow = SimpleNamespace(status=2)  # what the program would answer, a minute later
    # BatProblem imports scipy.optimize.linprog when it first solves: patched where it looks.
    monkeypatch.setattr(scipy.optimize, "linprog", lambda *a, **k: time.sleep(60) or slow)
    problem = truncation.BatProblem(np.log(np.full(4, 0.25)), np.zeros((4, 1)), 0.5)
    timer = threading.Timer(
        0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)
    )
    # Python's own SIGINT handler: a test runner's worker may ignore SIGINT (pytest-xdist's do).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            problem._program_feasible(0)
        assert time.monotonic() - start < 5
    finally:
        signal.signal(signal.SIGINT, previous)


def test_bat_bad_inputs_raise():
    W = np.zeros((3, 2))
    with pytest.raises(ValueError, match="tau must be in"):
        bn.bat_keep_mask(np.log([0.5, 0.25, 0.25]), W, tau=1.0)
    with pytest.raises(ValueError, match=r"W must be a floating \[M, d\]"):
        bn.bat_keep_mask(np.log([0.5, 0.5]), W, tau=0.1)
    with pytest.raises(ValueError, match="log_probs must hold no NaN"):
        bn.bat_keep_mask(np.array([0.0, np.nan, 0.0]), W, tau=0.1)
    with pytest.raises(ValueError, match="tokens must lie in"):
        bn.bat_keep_mask(np.log([0.5, 0.25, 0.25]), W, tau=0.1, tokens=[3])


# ---- bn.generate(..., bat_tau=...) -------------------------------------------------------------

V = 12
LSTM = AWDLSTM(V, emsize=8, nhid=16, nlayers=2, rngs=nnx.Rngs(0))
PROMPTS = np.random.default_rng(0).integers(0, V, (64, 2)).astype(np.int32)


def test_generate_with_bat_equals_plain_sampling_when_every_token_passes():
    key = jax.random.key(5)
    plain = bn.generate(LSTM, PROMPTS, 3, key=key, temperature=0.7)
    with_bat = bn.generate(LSTM, PROMPTS, 3, key=key, temperature=0.7, bat_tau=1e-9)
    np.testing.assert_array_equal(with_bat, plain)


def test_generate_with_bat_on_a_zero_decoder_never_draws_below_tau():
    controlled = np.array([0.02, 0.3, 0.005, 0.1, 0.15, 0.01, 0.2, 0.03, 0.005, 0.08, 0.04, 0.06])
    model = nnx.clone(LSTM)
    model.embedding.embedding.set_value(jnp.zeros_like(model.embedding.embedding[...]))
    model.head.bias.set_value(jnp.log(jnp.asarray(controlled, jnp.float32)))
    tokens = np.asarray(bn.generate(model, PROMPTS, 4, key=jax.random.key(0), bat_tau=0.035))
    drawn = np.unique(tokens)
    assert set(drawn) == set(np.flatnonzero(controlled >= 0.035))  # W = 0: the threshold rule


def test_generate_with_bat_needs_a_plain_softmax_head():
    mos = Transformer(V, d_model=8, num_layers=1, num_heads=2, max_len=8, head="mos",
                      num_components=2, rngs=nnx.Rngs(0))  # fmt: skip
    with pytest.raises(ValueError, match="bat_tau needs a plain softmax head"):
        bn.generate(mos, PROMPTS[:1], 2, key=jax.random.key(0), bat_tau=0.1)
    with pytest.raises(ValueError, match="bat_tau must be a number in"):
        bn.generate(LSTM, PROMPTS[:1], 2, key=jax.random.key(0), bat_tau=1.5)
