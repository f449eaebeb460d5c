"""Counter-based random numbers and the Gumbel-max sampler of the on-device token selection.

The numpy twin of csrc/tasks/sampling_rng.cuh: the same 64-bit words in both, bit for bit. A draw is
a pure function of (seed, step, sequence b, vocabulary id i), so any tile of any rank computes the
noise of its own columns with no state and no communication:

    key(seed, step, b) = mix(mix(mix(seed + G) + G (step + 1)) + G (b + 1))
    bits(seed, step, b, i) = mix(key + G (i + 1))          (splitmix64's i-th output from ``key``)
    u = (2 (bits >> 41) + 1) * 2^-24                        (float32, exact: 23 random bits, in (0, 1))
    g = -log(-log(u))                                       (a standard Gumbel draw, float32)

with G = 0x9E3779B97F4A7C15 and ``mix`` the splitmix64 finalizer. Sampling at temperature T picks
argmax_i (l_i * (1/T) + g_i) (the Gumbel-max trick: exactly a draw from softmax(l / T)); the product
and the sum are rounded separately (no fused multiply-add) on both sides. ``logf`` on the GPU and
numpy's float32 ``log`` may differ in the last bit, so CPU and GPU tokens can only differ where two
scores are within an ulp (a near-tie).

Nucleus (top-p < 1) keeps {i : bin(i) <= cut}: bin(i) = floor(z_i * BINS_PER_UNIT) with
z_i = (M - l_i) * (1/T) (float32, M the max logit over the whole vocabulary), for z_i < Z_RANGE
(NUCLEUS_BINS bins), and the cut is the last bin whose mass ABOVE it is < top_p of the total (torch's
rule: keep a token while the mass of the tokens before it is < top_p). Masses are exp(-z) in fixed
point (rint(exp(-z) * 2^MASS_SHIFT), uint64), so sums are exact and independent of the order in
which tiles and ranks add them. The boundary bin is kept whole: tokens within one bin width
(1/BINS_PER_UNIT in units of T, a probability ratio of e^(1/64) = 1.016) of torch's cut are kept
together, so the kept set is torch's nucleus plus, at most, the rest of its last bin. Tokens with
z >= Z_RANGE (probability < e^-32 of the top token's) carry no mass and are never kept.

The per-launch sampling state travels in a 4-word int32 buffer (``sampling_words``): temperature and
top_p as float32 bits, the 64-bit seed as two words. Temperature 0 means greedy (plain argmax).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError

GOLDEN = 0x9E3779B97F4A7C15
"""The splitmix64 increment (2^64 / golden ratio)."""
MIX_M1 = 0xBF58476D1CE4E5B9
MIX_M2 = 0x94D049BB133111EB
U_BITS = 23
"""Random bits per uniform: (2k + 1) * 2^-24 with k < 2^23 is exact in float32 and never 0 or 1."""
SAMPLING_WORDS = 4
"""int32 words of the sampling buffer: temperature bits, top_p bits, seed low, seed high."""
W_TEMPERATURE, W_TOP_P, W_SEED_LO, W_SEED_HI = range(SAMPLING_WORDS)

NUCLEUS_BINS = 2048
"""Bins of the top-p mass histogram."""
BINS_PER_UNIT = 64
"""Bins per unit of z = (M - l) / T: a power of two, so z * BINS_PER_UNIT is exact in float32."""
Z_RANGE = NUCLEUS_BINS / BINS_PER_UNIT
"""z covered by the bins (32: beyond it a token's mass e^-z rounds to 0 in fixed point anyway)."""
MASS_SHIFT = 44
"""Fixed-point scale of a bin's mass (the top token adds exactly 2^44)."""
MAX_NUCLEUS_VOCAB = 1 << 19
"""Vocabulary bound of top-p: V * 2^44 must stay below 2^63 (int64 sums in the interpreter)."""

_U64 = np.uint64


def mix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 values (wrapping arithmetic)."""
    z = np.asarray(z, dtype=_U64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _U64(30))) * _U64(MIX_M1)
        z = (z ^ (z >> _U64(27))) * _U64(MIX_M2)
    return z ^ (z >> _U64(31))


def _add_mul(x: np.ndarray, c) -> np.ndarray:
    """x + GOLDEN * (c + 1) mod 2^64."""
    with np.errstate(over="ignore"):
        return np.asarray(x, _U64) + _U64(GOLDEN) * (np.asarray(c, _U64) + _U64(1))


def stream_key(seed: int, step: int, b) -> np.ndarray:
    """The 64-bit key of (seed, step, sequence b) (b may be an array)."""
    k = mix64(_add_mul(np.asarray([int(seed) & (2**64 - 1)], _U64), 0))
    k = mix64(_add_mul(k, step))
    return mix64(_add_mul(k, b))


def random_bits(seed: int, step: int, b, ids) -> np.ndarray:
    """uint64 draws for (seed, step, b, ids): broadcast of b [..., 1] against ids [..., n]."""
    return mix64(_add_mul(stream_key(seed, step, b), ids))


def uniform(bits: np.ndarray) -> np.ndarray:
    """float32 uniforms in (0, 1) from uint64 draws (exact: the top 23 bits, centred in their cell)."""
    k = (np.asarray(bits, _U64) >> _U64(64 - U_BITS)).astype(np.float32)
    return (k * np.float32(2) + np.float32(1)) * np.float32(2.0 ** -(U_BITS + 1))


def gumbel(u: np.ndarray) -> np.ndarray:
    """Standard Gumbel draws -log(-log(u)) in float32."""
    u = np.asarray(u, np.float32)
    return -np.log(-np.log(u))


def inv_temperature(temperature: float) -> np.float32:
    """1 / T rounded once to float32 (the kernel divides in float32 too)."""
    return np.float32(1.0) / np.float32(temperature)


def gumbel_scores(logits: np.ndarray, temperature: float, seed: int, step: int, index_base: int = 0) -> np.ndarray:
    """Scores l * (1/T) + g of logits [B, n] whose column j is vocabulary id index_base + j (float32)."""
    x = np.asarray(logits, np.float32)
    B, n = x.shape
    ids = index_base + np.arange(n, dtype=np.int64)
    g = gumbel(uniform(random_bits(seed, step, np.arange(B)[:, None], ids[None, :])))
    return (x * inv_temperature(temperature)).astype(np.float32) + g


def sample_tokens(logits: np.ndarray, temperature: float, seed: int, step: int, top_p: float = 1.0) -> np.ndarray:
    """Tokens [B] the device would pick from full-vocabulary logits [B, V] (ties to the lowest id)."""
    x = np.asarray(logits, np.float32)
    if temperature <= 0:
        return x.argmax(-1)
    scores = gumbel_scores(x, temperature, seed, step)
    return np.where(nucleus_keep(x, temperature, top_p), scores, -np.inf).argmax(-1)


def nucleus_z(logits: np.ndarray, m: np.ndarray, inv_t: np.float32) -> np.ndarray:
    """z = (M - l) * (1/T) in float32, each operation rounded on its own (as the kernel)."""
    x = np.asarray(logits, np.float32)
    return ((np.asarray(m, np.float32) - x).astype(np.float32) * np.float32(inv_t)).astype(np.float32)


def nucleus_bin(z: np.ndarray) -> np.ndarray:
    """Bin of each z: floor(z * BINS_PER_UNIT) below Z_RANGE, else NUCLEUS_BINS (never kept); NaN too."""
    z = np.asarray(z, np.float32)
    inside = z < np.float32(Z_RANGE)
    k = np.floor(np.where(inside, z, 0) * np.float32(BINS_PER_UNIT)).astype(np.int64)
    return np.where(inside, k, NUCLEUS_BINS)


def nucleus_mass(z: np.ndarray) -> np.ndarray:
    """Fixed-point mass rint(exp(-z) * 2^MASS_SHIFT) (int64; 0 outside the bins)."""
    z = np.asarray(z, np.float32)
    inside = z < np.float32(Z_RANGE)
    e = np.exp(-np.where(inside, z, 0)).astype(np.float32) * np.float32(2.0 ** MASS_SHIFT)
    return np.where(inside, np.rint(e), 0).astype(np.int64)


def nucleus_histogram(logits: np.ndarray, m: np.ndarray, inv_t: np.float32) -> np.ndarray:
    """Mass per bin [B, NUCLEUS_BINS] (int64) of logits [B, n] against the row maxima m [B]."""
    z = nucleus_z(logits, np.asarray(m, np.float32)[:, None], inv_t)
    k, q = nucleus_bin(z), nucleus_mass(z)
    hist = np.zeros((z.shape[0], NUCLEUS_BINS + 1), np.int64)
    for b in range(z.shape[0]):
        np.add.at(hist[b], k[b], q[b])
    return hist[:, :NUCLEUS_BINS]


def nucleus_cut(hist: np.ndarray, top_p: float) -> np.ndarray:
    """Last kept bin per row [B]: the largest k with (mass of bins < k) < top_p * total, in float64."""
    h = np.asarray(hist, np.int64)
    above = np.cumsum(h, axis=-1) - h  # exact int64: mass of the bins before k
    target = np.float64(np.float32(top_p)) * h.sum(-1).astype(np.float64)
    ok = above.astype(np.float64) < target[:, None]
    return np.where(ok, np.arange(h.shape[-1]), -1).max(-1)


def nucleus_keep(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """bool [B, V]: the tokens the device's nucleus keeps from full-vocabulary logits [B, V]."""
    x = np.asarray(logits, np.float32)
    if temperature <= 0 or top_p >= 1:
        return np.ones(x.shape, bool)
    inv_t, m = inv_temperature(temperature), x.max(-1)
    cut = nucleus_cut(nucleus_histogram(x, m, inv_t), top_p)
    return nucleus_bin(nucleus_z(x, m[:, None], inv_t)) <= cut[:, None]


def match_picks(logits: np.ndarray, tokens, temperature: float, top_p: float, seed: int, step: int,
                score_tol: float, mass_tol: float) -> tuple[np.ndarray, np.ndarray]:
    """(exact [B], explained [B]): did another executor's picks ``tokens`` [B] from these logits [B, V]
    equal the twin's, or differ only by a near-tie?

    A pick is explained when it lies in the nucleus of top_p + mass_tol and its score is within
    score_tol of the best score over the nucleus of top_p - mass_tol: what logits off by a little
    (score_tol ~ their error / T, mass_tol ~ the mass that error moves) can flip. Greedy: scores are
    the logits."""
    x = np.asarray(logits, np.float32)
    tok = np.asarray(tokens, np.int64).reshape(-1)
    exact = sample_tokens(x, temperature, seed, step, top_p) == tok
    if temperature <= 0:
        scores, lo, hi = x, np.ones(x.shape, bool), np.ones(x.shape, bool)
    else:
        scores = gumbel_scores(x, temperature, seed, step)
        lo = nucleus_keep(x, temperature, max(top_p - mass_tol, 1e-9))
        hi = nucleus_keep(x, temperature, min(top_p + mass_tol, 1.0))
    rows = np.arange(len(tok))
    best = np.where(lo, scores, -np.inf).max(-1)
    return exact, exact | (hi[rows, tok] & (scores[rows, tok] >= best - score_tol))


def check_sampling(temperature: float, top_p: float, seed: int) -> None:
    """Raise InputError for values the device sampler does not take."""
    if not np.isfinite(temperature) or temperature < 0:
        raise InputError(f"--temperature: expected a finite number >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"--top-p: expected 0 < top_p <= 1, got {top_p}")
    if not 0 <= int(seed) < 2**64:
        raise InputError(f"--seed: expected 0 <= seed < 2^64, got {seed}")


def check_device_sampling(params) -> None:
    """check_sampling on a SamplingParams (temperature, top_p, seed)."""
    check_sampling(params.temperature, params.top_p, params.seed)


def sampling_words(temperature: float, top_p: float, seed: int) -> np.ndarray:
    """The int32 [SAMPLING_WORDS] contents of the sampling buffer for one launch (checked)."""
    check_sampling(temperature, top_p, seed)
    w = np.zeros(SAMPLING_WORDS, np.int32)
    w[W_TEMPERATURE] = np.float32(temperature).view(np.int32)
    w[W_TOP_P] = np.float32(top_p).view(np.int32)
    s = int(seed)
    w[W_SEED_LO] = np.uint32(s & 0xFFFFFFFF).view(np.int32)
    w[W_SEED_HI] = np.uint32(s >> 32).view(np.int32)
    return w


def unpack_words(words) -> tuple[float, float, int]:
    """(temperature, top_p, seed) from the sampling buffer's words (inverse of ``sampling_words``)."""
    w = np.asarray(words, np.int32).reshape(-1)
    seed = int(w[W_SEED_LO].view(np.uint32)) | (int(w[W_SEED_HI].view(np.uint32)) << 32)
    return float(w[W_TEMPERATURE].view(np.float32)), float(w[W_TOP_P].view(np.float32)), seed
