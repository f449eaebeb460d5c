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


def sample_tokens(logits: np.ndarray, temperature: float, seed: int, step: int) -> np.ndarray:
    """Tokens [B] the device would pick from full-vocabulary logits [B, V] (ties to the lowest id)."""
    x = np.asarray(logits, np.float32)
    if temperature <= 0:
        return x.argmax(-1)
    return gumbel_scores(x, temperature, seed, step).argmax(-1)


def check_sampling(temperature: float, top_p: float, seed: int) -> None:
    """Raise InputError for values the device sampler does not take."""
    if not np.isfinite(temperature) or temperature < 0:
        raise InputError(f"--temperature: expected a finite number >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"--top-p: expected 0 < top_p <= 1, got {top_p}")
    if not 0 <= int(seed) < 2**64:
        raise InputError(f"--seed: expected 0 <= seed < 2^64, got {seed}")


def check_device_sampling(params) -> None:
    """Raise InputError for SamplingParams the in-graph sampler cannot honour (top_p < 1 not yet)."""
    check_sampling(params.temperature, params.top_p, params.seed)
    if params.temperature > 0 and params.top_p < 1.0:
        raise InputError(f"--top-p: expected 1 with on-device sampling (nucleus sampling is not implemented in "
                         f"the task graph yet), got {params.top_p}; use --top-p 1 or --backend torch")


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
