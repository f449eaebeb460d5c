"""The sampling RNG and Gumbel-max sampler: uniform bits, exact softmax(l/T) frequencies, seeding,
the buffer words, and the CUDA header producing the same bits as numpy (host build with nvcc)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mpk_dist.backends.base import SamplingParams
from mpk_dist.errors import InputError
from mpk_dist.taskgraph import sampling_rng as R

CSRC_TASKS = Path(__file__).resolve().parents[2] / "csrc" / "tasks"
# Chi-square critical values at p = 0.001 (fixed seeds: a pass is deterministic, the bound says the
# generator is not measurably off).
CHI2_999 = {4: 18.47, 99: 148.23}


def chi2(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's statistic."""
    return float(((counts - expected) ** 2 / expected).sum())


def test_uniforms_are_uniform_and_in_the_open_interval():
    bits = R.random_bits(3, 0, np.zeros((1, 1), np.int64), np.arange(100_000)[None, :])[0]
    u = R.uniform(bits)
    assert u.dtype == np.float32 and u.min() > 0 and u.max() < 1
    counts = np.histogram(u, bins=100, range=(0, 1))[0]
    assert chi2(counts, np.full(100, 1000.0)) < CHI2_999[99]
    # Neighbouring streams (b, b + 1) and steps are not correlated: joint 10 x 10 cells of pairs.
    a = R.uniform(R.random_bits(3, 0, np.arange(2)[:, None], np.arange(50_000)[None, :]))
    joint = np.histogram2d(a[0], a[1], bins=10, range=[[0, 1], [0, 1]])[0].reshape(-1)
    assert chi2(joint, np.full(100, 500.0)) < CHI2_999[99]
    s = R.uniform(R.random_bits(3, 1, np.zeros((1, 1), np.int64), np.arange(50_000)[None, :]))[0]
    joint = np.histogram2d(a[0], s, bins=10, range=[[0, 1], [0, 1]])[0].reshape(-1)
    assert chi2(joint, np.full(100, 500.0)) < CHI2_999[99]


def test_gumbel_max_frequencies_match_softmax():
    """argmax(l/T + g) over 40000 independent draws (sequences b) is distributed as softmax(l/T)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    n, T = 40_000, 0.8
    x = np.broadcast_to(logits, (n, 5))
    picks = R.gumbel_scores(x, T, seed=11, step=4).argmax(-1)
    counts = np.bincount(picks, minlength=5)
    p = torch.softmax(torch.tensor(logits) / T, -1).numpy()
    assert chi2(counts, p * n) < CHI2_999[4], (counts, p * n)
    # the same draws at a much lower temperature almost always pick the argmax
    assert (R.gumbel_scores(x[:1000], 0.05, seed=11, step=4).argmax(-1) == 0).mean() > 0.99


def test_same_seed_same_tokens_other_seed_other_tokens():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 1000)).astype(np.float32)
    runs = {seed: [R.sample_tokens(logits, 1.0, seed, step).tolist() for step in range(8)] for seed in (1, 1 << 40, 7)}
    assert runs[1] == [R.sample_tokens(logits, 1.0, 1, step).tolist() for step in range(8)]
    assert runs[1] != runs[7] and runs[1] != runs[1 << 40]
    assert runs[1][0] != runs[1][1]  # the step is a counter of the draw too
    assert R.sample_tokens(logits, 0.0, 1, 0).tolist() == logits.argmax(-1).tolist()  # temperature 0: greedy


def test_scores_of_a_tile_equal_the_full_vocabulary_columns():
    """A tile's noise depends on the global vocabulary id only, so tiling cannot change a draw."""
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    full = R.gumbel_scores(x, 0.7, 5, 3)
    assert np.array_equal(np.concatenate([R.gumbel_scores(x[:, :40], 0.7, 5, 3),
                                          R.gumbel_scores(x[:, 40:], 0.7, 5, 3, index_base=40)], -1), full)


def test_sampling_words_round_trip_and_refusals():
    w = R.sampling_words(0.8, 0.9, (1 << 63) + 5)
    assert w.dtype == np.int32 and w.shape == (R.SAMPLING_WORDS,)
    t, p, s = R.unpack_words(w)
    assert (np.float32(t), np.float32(p), s) == (np.float32(0.8), np.float32(0.9), (1 << 63) + 5)
    assert R.unpack_words(np.zeros(4, np.int32)) == (0.0, 0.0, 0)  # a zeroed buffer: greedy
    for bad, match in (((-1.0, 1.0, 0), "temperature"), ((float("nan"), 1.0, 0), "temperature"),
                       ((1.0, 0.0, 0), "top-p"), ((1.0, 1.5, 0), "top-p"), ((1.0, 1.0, -1), "seed")):
        with pytest.raises(InputError, match=match):
            R.sampling_words(*bad)
    R.check_device_sampling(SamplingParams(0.8, 0.5, 0))
    with pytest.raises(InputError, match="top-p"):
        R.check_device_sampling(SamplingParams(0.8, 0.0, 0))


HOST_MAIN = r"""
#include <stdio.h>
#include "sampling_rng.cuh"
int main() {
  const unsigned long long seeds[3] = {0ull, 7ull, 0xFFFFFFFFFFFFFFFFull};
  for (int si = 0; si < 3; ++si)
    for (int step = 0; step < 3; ++step)
      for (int b = 0; b < 2; ++b) {
        const uint64_t key = mpk::rng_stream_key(seeds[si], step * 1000, b);
        for (int id = 0; id < 200000; id += 40000) {
          const uint64_t bits = mpk::rng_bits(key, id);
          const float u = mpk::rng_uniform(bits);
          printf("%llu %d %d %d %llu %.9e %.9e\n", seeds[si], step * 1000, b, id, (unsigned long long)bits,
                 u, mpk::rng_gumbel(u));
        }
      }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
def test_cuda_header_makes_the_same_bits_as_numpy(tmp_path):
    """sampling_rng.cuh built for the host (nvcc) prints the numpy twin's words exactly."""
    src = tmp_path / "rng.cu"
    src.write_text(HOST_MAIN)
    exe = tmp_path / "rng"
    subprocess.run(["nvcc", "-std=c++17", "-O2", f"-I{CSRC_TASKS}", "-o", str(exe), str(src)], check=True,
                   timeout=300, capture_output=True)
    rows = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout.split("\n")
    rows = [r.split() for r in rows if r]
    assert len(rows) == 3 * 3 * 2 * 5
    for seed, step, b, i, bits, u, g in rows:
        want = R.random_bits(int(seed), int(step), np.array([[int(b)]]), np.array([[int(i)]]))[0, 0]
        assert int(bits) == int(want), (seed, step, b, i)
        assert np.float32(float(u)) == R.uniform(want)
        assert abs(float(g) - float(R.gumbel(R.uniform(want)))) <= 2e-6 * max(1.0, abs(float(g)))


def _torch_nucleus(x: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """mpk_dist.backends.base.sample's kept set: sorted tokens while cumsum - own < top_p."""
    probs = torch.softmax(torch.tensor(x) / temperature, -1)
    sp, order = probs.sort(-1, descending=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, sp.cumsum(-1) - sp < top_p).numpy()


def test_nucleus_equals_torch_without_near_ties():
    """Logits 0.1 apart (8 bins at T = 0.8): every token has a bin of its own, so the device's kept set
    is exactly torch's nucleus."""
    rng = np.random.default_rng(4)
    x = np.stack([rng.permutation(-0.1 * np.arange(300)) for _ in range(3)]).astype(np.float32)
    for top_p in (0.05, 0.3, 0.5, 0.77, 0.9, 0.99):
        keep = R.nucleus_keep(x, 0.8, top_p)
        assert np.array_equal(keep, _torch_nucleus(x, 0.8, top_p)), top_p
    assert R.nucleus_keep(x, 0.8, 1.0).all() and R.nucleus_keep(x, 0.0, 0.5).all()


def test_nucleus_is_torch_plus_its_boundary_bin_on_dense_logits():
    x = (np.random.default_rng(5).standard_normal((4, 20_000)) * 2.5).astype(np.float32)
    for temperature, top_p in ((1.0, 0.9), (0.6, 0.5), (2.0, 0.95)):
        keep, ref = R.nucleus_keep(x, temperature, top_p), _torch_nucleus(x, temperature, top_p)
        assert (keep | ~ref).all()
        bins = R.nucleus_bin(R.nucleus_z(x, x.max(-1, keepdims=True), R.inv_temperature(temperature)))
        for b in range(4):
            assert set(bins[b][keep[b] & ~ref[b]].tolist()) <= {int(bins[b][ref[b]].max())}
        assert keep.sum() - ref.sum() < 0.05 * ref.sum()


def test_histogram_is_independent_of_tiling_and_top_token_always_kept():
    x = (np.random.default_rng(6).standard_normal((2, 1000)) * 4).astype(np.float32)
    m, inv_t = x.max(-1), R.inv_temperature(0.7)
    full = R.nucleus_histogram(x, m, inv_t)
    assert np.array_equal(sum(R.nucleus_histogram(x[:, a:a + 300], m, inv_t) for a in range(0, 1000, 300)), full)
    assert (full[:, 0] >= 2 ** R.MASS_SHIFT).all()  # the top token adds exactly 2^44 to bin 0
    assert (R.nucleus_cut(full, 1e-6) == 0).all()
    keep = R.nucleus_keep(x, 0.7, 1e-6)
    assert (keep.sum(-1) >= 1).all() and keep[np.arange(2), x.argmax(-1)].all()


def test_cuda_header_constants_equal_the_python_ones():
    text = (CSRC_TASKS / "sampling_rng.cuh").read_text()

    def const(name: str) -> float:
        import re

        return float(re.search(rf"constexpr \w+ {name} = ([0-9.eEx+A-Fa-f]+?)(?:u?ll|f)?;", text).group(1).rstrip("f"))
    assert const("kNucleusBins") == R.NUCLEUS_BINS and const("kBinsPerUnit") == R.BINS_PER_UNIT
    assert const("kZRange") == R.Z_RANGE and const("kMassScale") == 2.0 ** R.MASS_SHIFT
    assert const("kRngUBits") == R.U_BITS and "0x9E3779B97F4A7C15ull" in text
    assert f"0x{R.MIX_M1:X}ull" in text and f"0x{R.MIX_M2:X}ull" in text


def test_match_picks_tells_near_ties_from_wrong_picks():
    """The GPU tests' acceptance: exact picks, picks from slightly different logits (explained), and
    a pick outside the nucleus or far below the best score (not explained)."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((64, 400)) * 2).astype(np.float32)
    T, p, seed, step = 0.8, 0.9, 7, 5
    tok = R.sample_tokens(x, T, seed, step, p)
    exact, ok = R.match_picks(x, tok, T, p, seed, step, 0.0, 0.0)
    assert exact.all() and ok.all()
    noisy = x + (rng.standard_normal(x.shape) * 0.02).astype(np.float32)
    other = R.sample_tokens(noisy, T, seed, step, p)
    exact, ok = R.match_picks(x, other, T, p, seed, step, score_tol=0.1, mass_tol=0.05)
    assert ok.all() and exact.mean() > 0.8
    worst = x.argmin(-1)  # never in a 0.9 nucleus of 400 spread-out logits
    assert not R.match_picks(x, worst, T, p, seed, step, 0.1, 0.05)[1].any()
    assert R.match_picks(x, x.argmax(-1), 0.0, 1.0, 0, 0, 0.0, 0.0)[0].all()  # greedy
