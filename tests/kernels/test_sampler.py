"""Random sampling (temperature, top-k, Philox-keyed Gumbel-max) against numpy references.

Simulator shapes are tiny (V <= 151, blocks of <= 16 threads). The draws-heavy tests
launch the kernel on one block that grid-strides over all rows: the simulator pays
most of its time per block, not per row. The hash is checked bit for bit against a
pure-numpy Philox4x32-10 (and its published known answers); tokens are checked
exactly against a numpy sampler of the same definition (top-k by sorting, no
window), so the kernel's window and radix shortcuts must not change any token.

The kernel reads rows in 16-byte chunks after a scalar head: views whose rows start
at each of the 4 float32 offsets within a chunk (torch tensors, which the launcher
hands to the simulator without a copy) and a strided view (read one logit at a
time) give torch.argmax's and the reference's tokens; the simulator's 16-byte loads
fail on a misaligned address, so a wrong head cannot pass unseen.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from executor.kernels.primitives.launch import Kernel
from executor.kernels.sampling.sampler import (CHUNK, GROUP, MASK32, Sample, build_data_address, build_row_split, gumbel,
                                      philox4x32, seed_words, uniform_bits)
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90

cuda = load_cuda()
from numba import int64, uint64  # noqa: E402  (after load_cuda's numpy fix)

SIM_THREADS = 32
POISON = -7  # not a valid token id

# ------------------------------------------------------------------ numpy references

_M0, _M1, _W0, _W1 = (np.uint64(v) for v in (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85))
_MASK, _S32 = np.uint64(0xFFFFFFFF), np.uint64(32)


def philox_np(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10, vectorised over uint64 arrays holding 32-bit words."""
    c = [np.asarray(x, dtype=np.uint64) for x in (c0, c1, c2, c3)]
    k0, k1 = np.asarray(k0, dtype=np.uint64), np.asarray(k1, dtype=np.uint64)
    for _ in range(10):
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [(p1 >> _S32) ^ c[1] ^ k0, p1 & _MASK, (p0 >> _S32) ^ c[3] ^ k1, p0 & _MASK]
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c


def noise_np(seed: int, step: int, vocab: int, exact_logs: bool = True):
    """(32-bit words, float32 uniforms, float32 Gumbels) of elements 0..vocab-1 at (seed, step)."""
    s = np.array(seed, dtype=np.int64).view(np.uint64)
    words = philox_np(np.arange(vocab, dtype=np.uint64), np.uint64(int(step) & 0xFFFFFFFF), 0, 0,
                      s & _MASK, s >> _S32)[0]
    u = (words >> np.uint64(9)).astype(np.float32) * np.float32(2.0**-23) + np.float32(2.0**-24)
    if exact_logs:  # what the simulator computes: float64 math.log, rounded once to float32
        g = np.array([np.float32(-math.log(-math.log(float(v)))) for v in u], dtype=np.float32)
    else:
        g = (-np.log(-np.log(u.astype(np.float64)))).astype(np.float32)
    return words, u, g


def nucleus_np(x: np.ndarray, candidates: np.ndarray, top_p: float) -> np.ndarray:
    """The top-p nucleus inside ``candidates`` by the definition, in float64: the values v, largest first,
    until the softmax mass of {x >= v} over the candidates reaches top_p; every tie of the last is in."""
    if not 0 < top_p < 1:
        return candidates
    values = np.sort(x[candidates].astype(np.float64))[::-1]
    cumulative = np.cumsum(np.exp(values - values[0]))
    last = min(int(np.searchsorted(cumulative / cumulative[-1], np.float32(top_p))), values.size - 1)
    return candidates & (x.astype(np.float64) >= values[last])


def stable_reference_token(row, temperature, top_k, seed, step, top_p: float, exact_logs: bool = True,
                           slack: float = 1e-4) -> int:
    """reference_token, checked to give the same token with top_p moved by a relative ``slack`` either way:
    the kernel's float32 mass sums cannot then land on a nucleus with another winner."""
    tokens = {reference_token(row, temperature, top_k, seed, step, exact_logs, top_p=top_p * scale)
              for scale in (1 - slack, 1.0, 1 + slack)}
    assert len(tokens) == 1, f"top_p {top_p} sits on a nucleus edge whose winner changes: {tokens}"
    return tokens.pop()


def reference_token(row, temperature, top_k, seed, step, exact_logs: bool = True, top_p: float = 1.0) -> int:
    """The token the kernel must produce, by the definition (no window, top-k by sorting, the top-p
    nucleus of the top-k restricted softmax by sorting)."""
    row = np.asarray(row, dtype=np.float32)
    vocab = row.shape[0]
    greedy = int(torch.argmax(torch.from_numpy(row.copy())))
    t = np.float32(temperature)
    if not t > 0 or top_k == 1:
        return greedy
    with np.errstate(all="ignore"):
        inv_t = np.float32(1.0) / t
        x = row * inv_t
        x_top = row[greedy] * inv_t
    if not (np.isfinite(inv_t) and np.isfinite(x_top)):
        return greedy
    candidates = np.ones(vocab, dtype=bool)
    if 0 < top_k < vocab:
        candidates = row >= np.sort(row)[::-1][top_k - 1]  # ties with the k-th value stay in
    candidates = nucleus_np(x, candidates, top_p)
    _, _, g = noise_np(seed, step, vocab, exact_logs)
    return int(np.argmax(np.where(candidates, x + g, np.float32(-np.inf))))


# ------------------------------------------------------------------ helpers


def params(rows, temperature, top_k, seed, step, top_p=1.0):
    """Per-row parameter arrays (temperature, top_k, top_p, seed, step) from scalars or sequences."""
    return (np.broadcast_to(np.asarray(temperature, np.float32), (rows,)).copy(),
            np.broadcast_to(np.asarray(top_k, np.int32), (rows,)).copy(),
            np.broadcast_to(np.asarray(top_p, np.float32), (rows,)).copy(),
            np.broadcast_to(np.asarray(seed, np.int64), (rows,)).copy(),
            np.broadcast_to(np.asarray(step, np.int32), (rows,)).copy())


def run_sample(logits, temperature, top_k, seed, step, max_threads: int = SIM_THREADS, top_p=1.0) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float32)
    out = np.full(logits.shape[0], POISON, dtype=np.int32)
    Sample(max_threads)(logits, *params(logits.shape[0], temperature, top_k, seed, step, top_p), out)
    assert (out != POISON).all(), "a row was not written"
    return out


def launch(logits, temperature, top_k, seed, step, blocks: int, threads: int, top_p=1.0) -> np.ndarray:
    """The kernel on ``blocks`` blocks of ``threads`` (fewer blocks than rows: they grid-stride)."""
    out = np.full(logits.shape[0], POISON, dtype=np.int32)
    Sample(SIM_THREADS).kernel[blocks, threads](logits, *params(logits.shape[0], temperature, top_k, seed, step, top_p),
                                                out)
    assert (out != POISON).all(), "a row was not written"
    return out


def draw_many(row, temperature, top_k, seed, steps, threads: int, top_p=1.0) -> np.ndarray:
    """One token per step for one logits row, one launch: a single block grid-strides the rows."""
    logits = np.tile(np.asarray(row, np.float32), (len(steps), 1))
    return launch(logits, temperature, top_k, seed, steps, blocks=1, threads=threads, top_p=top_p)


def argmax_np(logits) -> np.ndarray:
    return torch.argmax(torch.from_numpy(np.asarray(logits, np.float32)), dim=-1).numpy()


# ------------------------------------------------------------------ the hash


@cuda.jit
def _philox_kernel(counters, keys, out):
    n = cuda.grid(1)
    if n < counters.shape[0]:
        w0, w1, w2, w3 = philox4x32(counters[n, 0], counters[n, 1], counters[n, 2], counters[n, 3],
                                    keys[n, 0], keys[n, 1])
        out[n, 0] = w0
        out[n, 1] = w1
        out[n, 2] = w2
        out[n, 3] = w3


@cuda.jit
def _noise_kernel(seed, step, words, noise):
    b = cuda.blockIdx.x
    key0, key1 = seed_words(seed[b])
    step_word = uint64(int64(step[b])) & MASK32
    for i in range(cuda.threadIdx.x, words.shape[1], cuda.blockDim.x):
        words[b, i] = uniform_bits(key0, key1, step_word, uint64(i))
        noise[b, i] = gumbel(key0, key1, step_word, uint64(i))


# Random123's published known-answer vectors for philox4x32 with 10 rounds.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_known_answers_device_and_numpy():
    counters = np.array([c for c, _, _ in KNOWN_ANSWERS], dtype=np.uint64)
    keys = np.array([k for _, k, _ in KNOWN_ANSWERS], dtype=np.uint64)
    expected = np.array([a for _, _, a in KNOWN_ANSWERS], dtype=np.uint64)
    out = np.zeros_like(expected)
    _philox_kernel[1, 4](counters, keys, out)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(np.stack(philox_np(*counters.T, *keys.T), axis=1), expected)


def test_noise_bits_match_numpy():
    """Words, then Gumbels, of the device path (seed/step handling included) against numpy."""
    seeds = [0, 1, -1, 0x123456789ABCDEF, -(2**63), 2**63 - 1]
    steps = [0, 7, 2**31 - 1, 12345, -1, 3]
    vocab = 40
    words = np.zeros((len(seeds), vocab), dtype=np.uint64)
    noise = np.zeros((len(seeds), vocab), dtype=np.float32)
    _noise_kernel[len(seeds), 16](np.array(seeds, np.int64), np.array(steps, np.int32), words, noise)
    for b, (seed, step) in enumerate(zip(seeds, steps)):
        expected_words, u, g = noise_np(seed, step, vocab)
        np.testing.assert_array_equal(words[b], expected_words)
        np.testing.assert_array_equal(noise[b].view(np.int32), g.view(np.int32))
        assert (u > 0).all() and (u < 1).all() and np.isfinite(g).all()
    assert len({tuple(w) for w in words.tolist()}) == len(seeds)  # every (seed, step) its own stream


# ------------------------------------------------------------------ greedy rows


def tie_and_nan_rows() -> np.ndarray:
    logits = np.zeros((4, 50), dtype=np.float32)
    logits[0, [40, 9, 33]] = 3.0  # a tie: the first index wins
    logits[1] = np.random.default_rng(1).standard_normal(50)
    logits[2, [3, 40, 45]] = [np.inf, np.nan, np.nan]  # NaN beats +inf; the first NaN wins
    logits[3, :] = -np.inf  # all -inf: index 0
    return logits


@pytest.mark.parametrize("temperature", [0.0, -1.0, np.nan])
def test_greedy_rows_equal_argmax(temperature):
    logits = tie_and_nan_rows()
    got = run_sample(logits, temperature, [0, 5, 1, 64], [3, -4, 5, 6], [0, 1, 2, 3])
    np.testing.assert_array_equal(got, argmax_np(logits))
    assert list(got) == [9, int(argmax_np(logits)[1]), 40, 0]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 1 / 1e-45 in a simulator thread
def test_non_finite_rows_are_greedy_when_sampling():
    """NaN anywhere, +inf, all -inf, or T so small that 1/T overflows: argmax in every mode."""
    logits = tie_and_nan_rows()
    logits[0, 17] = np.inf
    got = run_sample(logits, [1.0, 1e-45, 2.0, 0.5], [0, 0, 3, 10], 99, 4)
    np.testing.assert_array_equal(got, argmax_np(logits))


def test_top_k_one_is_argmax_at_any_temperature():
    logits = np.random.default_rng(2).standard_normal((4, 37)).astype(np.float32) * 3
    logits[3, [5, 30]] = logits[3].max() + 1.0  # tie: the first index
    expected = argmax_np(logits)
    for temperature, step in [(0.3, 0), (1.0, 1), (100.0, 2)]:
        np.testing.assert_array_equal(run_sample(logits, temperature, 1, [11, 12, 13, 14], step), expected)


# ------------------------------------------------------------------ sampled rows


def row_cases():
    """(name, logits [4, V], temperature, top_k, path the top-k rows take)."""
    rng = np.random.default_rng(3)
    flat = rng.standard_normal((4, 50)).astype(np.float32)
    spread = (rng.standard_normal((4, 64)) * 40).astype(np.float32)
    ties = (np.round(rng.standard_normal((4, 64)) * 2) / 2).astype(np.float32)  # many ties: all 8 radix passes
    ties[0, :10] = -np.inf
    zeros = np.zeros((4, 64), dtype=np.float32)
    zeros[:, ::2] = -0.0  # -0.0 ties +0.0 at the k-th value
    zeros[:, 3] = zeros[:, 9] = 1.0
    return [
        ("unrestricted", flat, 1.0, 0),
        ("k>=V", flat, 0.7, 50),
        ("radix", flat, 0.7, 5),
        ("window shortcut", spread, 1.0, 10),
        ("tied k-th value", ties, 1.5, 7),
        ("signed zeros", zeros, 2.0, 4),
    ]


@pytest.mark.parametrize("case", row_cases(), ids=lambda c: c[0])
def test_tokens_match_numpy_reference(case):
    name, logits, temperature, top_k = case
    seeds, steps = [5, -6, 2**40 + 7, 8], [0, 3, 2**20, 9]
    got = run_sample(logits, temperature, top_k, seeds, steps)
    expected = [reference_token(logits[b], temperature, top_k, seeds[b], steps[b]) for b in range(4)]
    assert list(got) == expected
    if name in ("radix", "window shortcut"):  # the path the case is meant to take
        x = logits * np.float32(1.0 / temperature)
        top = x.max(axis=1, keepdims=True)
        inside = (x >= top - (21.0 + np.abs(top) * 2.0**-20)).sum(axis=1)
        assert ((inside > top_k) if name == "radix" else (inside <= top_k)).all()


def test_samples_stay_in_the_top_k_set():
    row = np.random.default_rng(4).uniform(-1, 0, 32).astype(np.float32)
    row[[20, 3, 27, 11]] = [0.5, 0.4, 0.3, 0.3]  # k = 3: 20, 3 and both ties of the third value
    got = draw_many(row, 10.0, 3, 77, np.arange(32), threads=4)
    assert set(got.tolist()) == {20, 3, 27, 11}  # never outside; every candidate shows up at T = 10


def test_same_request_same_token_in_any_batch():
    """A token depends on (seed, step, logits, T, k) only: not on batch position, neighbours or block size."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((4, 64)).astype(np.float32) * 2
    temperature, top_k = [1.0, 0.8, 1.3, 0.0], [0, 6, 40, 0]
    seeds, steps = [101, 102, 101, 104], [7, 7, 8, 0]
    alone = [run_sample(logits[[b]], temperature[b], top_k[b], seeds[b], steps[b])[0] for b in range(4)]
    assert list(run_sample(logits, temperature, top_k, seeds, steps)) == alone
    order = [2, 0, 3, 1]
    reordered = (logits[order], [temperature[b] for b in order], [top_k[b] for b in order],
                 [seeds[b] for b in order], [steps[b] for b in order])
    # Blocks of 16 threads: a thread holds at most 1 chunk of a row (the launcher's 4 threads hold 4).
    assert list(launch(*reordered, blocks=1, threads=16)) == [alone[b] for b in order]


def test_steps_and_seeds_change_the_token():
    row = np.zeros(64, dtype=np.float32)  # uniform over 64 tokens
    by_step = draw_many(row, 1.0, 0, 2024, np.arange(24), threads=8)
    by_seed = np.concatenate([draw_many(row, 1.0, 0, seed, [5], threads=8) for seed in (1, 2, 3)])
    assert len(set(by_step.tolist())) >= 14  # about 20 distinct expected
    assert len(set(by_seed.tolist())) >= 2
    assert not (draw_many(row, 1.0, 0, 2025, np.arange(24), threads=8) == by_step).all()


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


ROW8 = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0], dtype=np.float32)


def test_distribution_matches_softmax():
    draws = draw_many(ROW8, 0.8, 0, 31337, np.arange(320), threads=4)
    counts = np.bincount(draws, minlength=8)
    # df = 7; 30 is far in the tail (p ~ 1e-4); the draws are deterministic, so this never flakes.
    assert chi_square(counts, softmax(ROW8.astype(np.float64) / 0.8)) < 30.0, counts


def test_top_k_distribution_matches_restricted_softmax():
    draws = draw_many(ROW8, 1.5, 3, 4242, np.arange(192), threads=4)
    counts = np.bincount(draws, minlength=8)
    kept = [0, 6, 1]  # the three largest logits: 2.0, 1.5, 1.0
    assert counts.sum() == counts[kept].sum()
    assert chi_square(counts[kept], softmax(ROW8[kept].astype(np.float64) / 1.5)) < 18.0, counts  # df = 2


# ------------------------------------------------------------------ top-p


def top_p_cases():
    """(name, logits [4, V], temperature, top_k, top_p per row)."""
    rng = np.random.default_rng(13)
    flat = rng.standard_normal((4, 50)).astype(np.float32)
    ties = (np.round(rng.standard_normal((4, 64)) * 2) / 2).astype(np.float32)  # the nucleus ends on a tie
    tail = np.full((4, 151), -21.01, np.float32)  # outside the window: part of Z, never a candidate
    tail[:, [7, 70, 140]] = [0.0, -0.5, -20.0]
    below_one = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
    return [
        ("nucleus", flat, 1.0, 0, [0.9, 0.5, 0.2, 0.75]),
        ("top-k then nucleus", flat, 0.7, [5, 20, 3, 49], [0.6, 0.9, 0.99, 0.3]),
        ("tied nucleus edge", ties, 1.5, 0, [0.8, 0.4, 0.95, 0.6]),
        ("tiny p: the max and its ties", ties, 2.0, 0, 1e-6),
        ("p just below 1, a tail outside the window", tail, 1.0, 0, below_one),
    ]


@pytest.mark.parametrize("case", top_p_cases(), ids=lambda c: c[0])
def test_top_p_tokens_match_numpy_reference(case):
    name, logits, temperature, top_k, top_p = case
    seeds, steps = [5, -6, 2**40 + 7, 8], [0, 3, 2**20, 9]
    top_k, top_p = np.broadcast_to(top_k, (4,)), np.broadcast_to(np.asarray(top_p, np.float32), (4,))
    got = run_sample(logits, temperature, top_k, seeds, steps, top_p=top_p)
    slack = 1e-9 if name.startswith("p just below 1") else 1e-4  # that p is the float32 just below 1
    expected = [stable_reference_token(logits[b], temperature, int(top_k[b]), seeds[b], steps[b], float(top_p[b]),
                                       slack=slack) for b in range(4)]
    assert list(got) == expected


def test_top_p_one_equals_plain_temperature_sampling():
    rng = np.random.default_rng(14)
    logits = rng.standard_normal((4, 40)).astype(np.float32) * 2
    temperature, top_k, seeds, steps = [0.8, 1.0, 1.3, 0.6], [0, 7, 0, 30], [1, 2, 3, 4], [5, 6, 7, 8]
    plain = run_sample(logits, temperature, top_k, seeds, steps)
    assert list(run_sample(logits, temperature, top_k, seeds, steps, top_p=1.0)) == list(plain)
    assert list(plain) == [reference_token(logits[b], temperature[b], top_k[b], seeds[b], steps[b]) for b in range(4)]


def test_samples_stay_in_the_nucleus():
    row = np.full(32, -4.0, np.float32)
    row[[9, 21, 2]] = [1.0, 0.9, 0.8]  # about 0.95 of the mass at T = 1; p = 0.9 needs all three
    got = draw_many(row, 1.0, 0, 55, np.arange(48), threads=4, top_p=0.9)
    assert set(got.tolist()) == {9, 21, 2}


def test_top_p_distribution_matches_the_renormalised_nucleus():
    probs = softmax(ROW8.astype(np.float64) / 1.2)
    kept = [0, 6, 1, 2]  # 2.0, 1.5, 1.0, 0.5: the first three hold < 0.8 of the mass, four > 0.8
    assert probs[kept[:3]].sum() < 0.8 < probs[kept].sum()
    draws = draw_many(ROW8, 1.2, 0, 777, np.arange(128), threads=4, top_p=0.8)
    counts = np.bincount(draws, minlength=8)
    assert counts.sum() == counts[kept].sum()
    assert chi_square(counts[kept], probs[kept] / probs[kept].sum()) < 20.0, counts  # df = 3


def test_top_p_token_does_not_depend_on_the_batch():
    rng = np.random.default_rng(15)
    logits = rng.standard_normal((3, 64)).astype(np.float32)
    temperature, top_k, top_p, seeds, steps = [1.0, 0.9, 1.1], [0, 12, 0], [0.7, 0.85, 0.5], [9, 8, 7], [1, 2, 3]
    alone = [run_sample(logits[[b]], temperature[b], top_k[b], seeds[b], steps[b], top_p=top_p[b])[0]
             for b in range(3)]
    assert list(run_sample(logits, temperature, top_k, seeds, steps, top_p=top_p)) == alone


# ------------------------------------------------------------------ rows that start anywhere

VIEW_VOCAB = 151  # 37 chunks and a head or tail: 2 sweeps of CHUNK_THREADS x GROUP logits, the second partial
CHUNK_THREADS = 4
assert VIEW_VOCAB > CHUNK_THREADS * GROUP
ROW_SPLIT = build_row_split(build_data_address())


def row_views(rows: int = 4) -> dict[str, torch.Tensor]:
    """Float32 views of rows x VIEW_VOCAB whose rows start at each 4-byte offset of a 16-byte chunk.

    torch tensors: the launcher passes the simulator a view of the same memory (a numpy argument
    would be copied to a fresh array).
    """
    gen = torch.Generator().manual_seed(8)
    big = torch.randn(rows + 2, 2 * VIEW_VOCAB + 2, generator=gen) * 3
    return {
        "V % 4 == 3": big[:rows, :VIEW_VOCAB].contiguous(),  # row b starts at lane 3b % 4
        "row slice": big[:, :VIEW_VOCAB].contiguous()[1 : rows + 1],  # the first row starts at lane 3
        "column slice": big[:rows, 1 : VIEW_VOCAB + 1],  # rows 2V + 2 = 304 logits apart: each from lane 1
        "strided": big[:rows, : 2 * VIEW_VOCAB : 2],  # no chunks: a logit at a time
    }


def start_lanes(view: torch.Tensor) -> set[int]:
    """The float32 offsets within their 16-byte chunks at which the rows of ``view`` start."""
    return {(view[b].data_ptr() % 16) // 4 for b in range(view.shape[0])}


@cuda.jit
def _row_split_kernel(logits, out):
    b = cuda.grid(1)
    if b < logits.shape[0]:
        head, chunks = ROW_SPLIT(logits, b)
        out[b, 0] = head
        out[b, 1] = chunks


def test_row_split_finds_each_rows_head():
    """(head, chunks) of every row from the row's own address; a strided view has no chunks."""
    views = row_views()
    assert set.union(*(start_lanes(v) for v in views.values())) == {0, 1, 2, 3}
    for name, view in views.items():
        out = np.zeros((view.shape[0], 2), np.int64)
        Kernel(_row_split_kernel)[1, 8](view, out)
        for b in range(view.shape[0]):
            head = min(VIEW_VOCAB, -(view[b].data_ptr() // 4) % CHUNK)
            expected = (VIEW_VOCAB, 0) if name == "strided" else (head, (VIEW_VOCAB - head) // CHUNK)
            assert tuple(out[b]) == expected, (name, b)


def tie_rows(view: torch.Tensor) -> None:
    """Rewrite ``view``'s rows in place: ties of the maximum across the head, chunk, sweep and tail
    boundaries of the kernel's reads, signed zeros, NaN and inf (torch.argmax's rules)."""
    view.zero_()
    view[0, [150, 149, 36, 35, 4, 3]] = 5.0  # the tail's last, chunk edges; 3 is the head's end or a chunk's
    view[1, [131, 130, 129, 128, 2]] = 5.0  # second sweep vs. a head or first chunk
    view[2, :] = -0.0
    view[2, [100, 7]] = 0.0  # -0.0 ties +0.0: index 0
    view[3, [140, 64, 33, 1]] = torch.tensor([np.nan, np.inf, np.nan, np.inf])  # the first NaN beats every inf


@pytest.mark.parametrize("name", list(row_views()))
def test_greedy_on_rows_that_start_anywhere(name):
    """torch.argmax of random rows, then of rows of ties, NaN and inf placed across the kernel's boundaries."""
    view = row_views()[name]
    expected = torch.argmax(view, dim=-1).tolist()
    assert launch(view, 0.0, 0, 1, 2, blocks=4, threads=CHUNK_THREADS).tolist() == expected
    tie_rows(view)
    got = launch(view, [0.0, -1.0, 0.0, 0.5], [0, 0, 0, 7], 1, 2, blocks=1, threads=CHUNK_THREADS)
    assert got.tolist() == torch.argmax(view, dim=-1).tolist() == [3, 2, 0, 33]


@pytest.mark.parametrize("name", ["V % 4 == 3", "column slice", "strided"])
def test_sampled_tokens_on_rows_that_start_anywhere(name):
    """Unrestricted, radix top-k and window-count top-k rows against the reference."""
    view = row_views()[name]
    view[3] *= 0.05  # flat: the whole row in the window
    temperature, top_k, seeds, steps = [1.0, 0.7, 0.15, 1.0], [0, 3, 40, 9], [3, -4, 5, 2**40], [0, 1, 2, 3]
    host = view.numpy()
    x = host * (1 / np.array(temperature, np.float32))[:, None]
    top = x.max(axis=1)
    inside = (x >= (top - (21.0 + np.abs(top) * 2.0**-20))[:, None]).sum(axis=1)
    assert list(inside[1:] > top_k[1:]) == [True, False, True]  # radix select, window shortcut, radix select
    got = launch(view, temperature, top_k, seeds, steps, blocks=1, threads=CHUNK_THREADS)
    assert got.tolist() == [reference_token(host[b], temperature[b], top_k[b], seeds[b], steps[b]) for b in range(4)]


# ------------------------------------------------------------------ launcher


def test_launcher_shape_errors_and_empty_batch():
    logits = np.zeros((2, 8), np.float32)
    t, k, p, s, st = params(2, 1.0, 0, 0, 0)
    with pytest.raises(ValueError, match="out_ids"):
        Sample(SIM_THREADS)(logits, t, k, p, s, st, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="top_k"):
        Sample(SIM_THREADS)(logits, t, np.zeros(1, np.int32), p, s, st, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="top_p"):
        Sample(SIM_THREADS)(logits, t, k, np.ones(3, np.float32), s, st, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="empty vocabulary"):
        Sample(SIM_THREADS)(np.zeros((2, 0), np.float32), t, k, p, s, st, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="power of two"):
        Sample(1024)
    Sample(SIM_THREADS)(np.zeros((0, 8), np.float32), *params(0, 1.0, 0, 0, 0), np.zeros(0, np.int32))


@pytest.mark.ptx
def test_sample_compiles_for_sm90_with_16_byte_loads():
    """PTX for sm_90: no float64 (checked by compile_for_sm90), the row passes' 16-byte loads
    (argmax, window count, radix, Gumbel: UNROLL each), and no local memory (the loaded chunks
    in registers)."""
    compile_for_sm90("""
        from executor.kernels.sampling.sampler import UNROLL, build_sample_kernel
        i32 = arr("int32", 1)
        text = ptx(build_sample_kernel(), arr("float32", 2), arr("float32", 1), i32, arr("float32", 1),
                   types.Array(types.int64, 1, "A"), i32, i32)
        loads = text.count("ld.global.v4.f32")
        assert loads >= 4 * UNROLL, f"sample kernel: {loads} 16-byte loads, expected at least {4 * UNROLL}"
        assert ".local" not in text, "sample kernel uses local memory"
    """)


# ------------------------------------------------------------------ GPU at real sizes


@pytest.mark.gpu
def test_gpu_noise_bits_match_numpy():
    seeds = torch.tensor([0, -1, 0x123456789ABCDEF, 2**63 - 1], dtype=torch.int64, device="cuda")
    steps = torch.tensor([0, 2**31 - 1, 12345, 3], dtype=torch.int32, device="cuda")
    vocab = 4096
    words = torch.zeros((4, vocab), dtype=torch.int64, device="cuda")
    noise = torch.zeros((4, vocab), dtype=torch.float32, device="cuda")
    _noise_kernel[4, 256](seeds, steps, words, noise)
    torch.cuda.synchronize()
    for b in range(4):
        expected_words, _, g = noise_np(int(seeds[b]), int(steps[b]), vocab, exact_logs=False)
        np.testing.assert_array_equal(words[b].cpu().numpy().view(np.uint64), expected_words)
        np.testing.assert_allclose(noise[b].cpu().numpy(), g, rtol=2e-6, atol=2e-6)  # logf vs rounded float64 log


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,offset", [(151936, 0), (248320, 0), (151935, 1)])
def test_gpu_tokens_match_numpy_reference(vocab, offset):
    """Real vocabularies; with V % 4 == 3 and the view ``offset`` logits into its buffer, the rows start
    at every offset within a 16-byte chunk."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    rows = 8
    logits = (torch.randn(rows * vocab + offset, device="cuda", generator=gen) * 3)[offset:].view(rows, vocab)
    logits[1] *= 0.05  # flat: the window holds the whole vocabulary, top-k goes through the radix select
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.2, 0.9, 2.0, 0.6, 1.0], device="cuda")
    top_k = torch.tensor([0, 50, 0, 400, 1, 20, 0, 100], dtype=torch.int32, device="cuda")
    seed = torch.arange(rows, dtype=torch.int64, device="cuda") * 7919 - 3
    step = torch.arange(rows, dtype=torch.int32, device="cuda") * 13
    out = torch.full((rows,), POISON, dtype=torch.int32, device="cuda")
    top_p = torch.ones(rows, device="cuda")
    Sample()(logits, temperature, top_k, top_p, seed, step, out)
    torch.cuda.synchronize()
    host = logits.cpu().numpy()
    expected = [reference_token(host[b], float(temperature[b]), int(top_k[b]), int(seed[b]), int(step[b]),
                                exact_logs=False) for b in range(rows)]
    assert out.cpu().tolist() == expected


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 248320])
def test_gpu_top_p_tokens_match_numpy_reference(vocab):
    """Top-p at real vocabularies: peaked rows (the radix select over the window) and a flat one (every
    logit in the window), with and without top-k; each expected token holds for p moved by 1e-4 either way."""
    gen = torch.Generator(device="cuda").manual_seed(16)
    rows = 6
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 3
    logits[2] *= 0.02  # flat
    temperature = torch.tensor([1.0, 0.7, 1.0, 0.6, 1.3, 0.9], device="cuda")
    top_k = torch.tensor([0, 50, 0, 0, 400, 20], dtype=torch.int32, device="cuda")
    top_p = torch.tensor([0.9, 0.8, 0.95, 0.5, 0.97, 0.3], device="cuda")
    seed = torch.arange(rows, dtype=torch.int64, device="cuda") * 104729 + 1
    step = torch.arange(rows, dtype=torch.int32, device="cuda") * 17
    out = torch.full((rows,), POISON, dtype=torch.int32, device="cuda")
    Sample()(logits, temperature, top_k, top_p, seed, step, out)
    torch.cuda.synchronize()
    host = logits.cpu().numpy()
    expected = [stable_reference_token(host[b], float(temperature[b]), int(top_k[b]), int(seed[b]), int(step[b]),
                                       float(top_p[b]), exact_logs=False) for b in range(rows)]
    assert out.cpu().tolist() == expected
