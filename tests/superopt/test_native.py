"""native: the C loop of ``StructureSieve.values_r`` gives numpy's values (its reference), the
library builds into the cache dir, and without it the numpy path runs."""


import numpy as np
import pytest

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt import native
from mpk_dist.superopt.blockmemo import Fingerprint
from mpk_dist.superopt.blockshare import SharedFinal
from mpk_dist.superopt.sieve import FIELD31

needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """``native.library`` tried again, building into an empty cache dir."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_STATE", {})
    return tmp_path


@needs_cc
def test_library_builds_into_the_cache_dir_and_loads(fresh):
    lib = native.library()
    assert lib is not None and native.library() is lib
    assert len(list((fresh / "superopt" / "native").glob("superopt_*.so"))) == 1
    assert not list((fresh / "superopt" / "native").glob("*.c"))


@needs_cc
@pytest.mark.parametrize("r", [FIELD31[1], 101])
def test_bin_r_is_numpys_sum_and_product_modulo_r(fresh, r):
    """Random groups (the constant-modulus loop and the general one): the results equal numpy's
    (a + b) % r and a * b % r, and no other position changes."""
    rng = np.random.default_rng(r)
    lib = native.library()
    for add in (0, 1):
        v = rng.integers(0, r, 5000).astype(np.int32)
        out = rng.choice(np.arange(2500, 5000), 2000, replace=False).astype(np.int32)
        a, b = (rng.integers(0, 2500, 2000).astype(np.int32) for _ in range(2))
        want = v.copy()
        want[out] = (v[a] + v[b]) % r if add else v[a] * v[b] % r
        lib.sieve_bin_r(v.ctypes.data, out.ctypes.data, a.ctypes.data, b.ctypes.data,
                        len(out), add, r)
        assert v.tolist() == want.tolist()


def _sieves(t0_signature):
    """Sieves of last-op signatures with a made first-op output t0 (attention: exp chains and
    div; rms_norm -> matmul: the x*x and sqrt chains), with leaves for two input orders."""
    fp31 = Fingerprint(sized=False, field=FIELD31)
    for name, shape in [("attention_decode", {"H": 4, "D": 64, "S": 256}),
                        ("rmsnorm_linear", {"M": 2, "K": 64, "N": 32})]:
        target, infos, config, ctx = t0_signature(name, shape)
        for lay in list(B.layouts(tuple(infos), infos, 1))[:8]:
            sym_size = {s: x for k in lay.inputs
                        for s, x in zip(infos[k].syms, infos[k].shape) if s}
            sizes = B.representative_sizes(lay, infos, sym_size, config)
            if sizes is None:
                continue
            sv = SharedFinal(ctx, lay, infos, sizes, sym_size).sieve
            for names in (lay.inputs, lay.inputs[::-1]):
                yield sv, tuple(fp31.of_expr(infos[n].expr) for n in names)


@needs_cc
def test_values_r_in_c_equals_numpy(fresh, t0_signature):
    """``values_r`` runs its add / mul / div groups in C and gives ``values_r_numpy``'s array
    (and ``values``'s r parts) for every structure of real signatures."""
    compared = calls = 0
    for sv, leaves in _sieves(t0_signature):
        before = sv.r_native
        got = sv.values_r(leaves)
        calls += sv.r_native - before
        ref = sv.values_r_numpy(leaves)
        assert got.dtype == np.int32 and got.tolist() == ref.tolist()
        assert got.tolist() == sv.values(leaves)[1].tolist()
        compared += sv.n
    assert compared > 10_000 and calls > 10, (compared, calls)


def test_without_the_library_values_r_is_numpys(fresh, monkeypatch, t0_signature):
    monkeypatch.setenv("MPK_SUPEROPT_NATIVE", "0")
    assert native.library() is None
    sv, leaves = next(_sieves(t0_signature))
    assert sv.values_r(leaves).tolist() == sv.values_r_numpy(leaves).tolist()
    assert sv.r_native == 0


@needs_cc
def test_find_is_flatnonzero(fresh):
    """``sieve_find``: the ascending positions of the roots whose value is the wanted one."""
    rng = np.random.default_rng(5)
    lib = native.library()
    v = rng.integers(0, 7, 4000).astype(np.int32)
    roots = rng.integers(0, 4000, 3000).astype(np.int32)
    for want in range(8):
        cand = np.empty(len(roots), np.int64)
        k = lib.sieve_find(v.ctypes.data, roots.ctypes.data, len(roots), want, cand.ctypes.data)
        assert cand[:k].tolist() == np.flatnonzero(v[roots] == want).tolist()


@needs_cc
def test_matches_in_c_is_the_full_test(fresh, t0_signature):
    """``matches`` with the C loops gives ``matches_full``'s array for the target's value and
    for values some roots have."""
    compared = matched = 0
    for sv, leaves in _sieves(t0_signature):
        vp, vr = sv.values(leaves)
        wants = [(vp[r], vr[r]) for r in sv.roots[::max(1, len(sv.roots) // 5)].tolist()]
        for want in wants + [(1, 1)]:
            got = sv.matches(leaves, want)
            assert got.tolist() == sv.matches_full(leaves, want).tolist()
            compared += len(got)
            matched += int(got.sum())
    assert compared > 10_000 and matched > 10


@needs_cc
def test_chain_groups_by_table(fresh, monkeypatch, t0_signature):
    """With the C loops, chain groups are read from one table per program (``_chain_table``):
    the same r parts as ``values_r_numpy``, with ``_chain_r`` (its recursion counted) run once
    per program and sieve instead of for every chain group of every call."""
    from mpk_dist.superopt.sieve import StructureSieve

    real, calls = StructureSieve._chain_r, [0]

    def counted(self, prog, x):
        calls[0] += 1
        return real(self, prog, x)

    monkeypatch.setattr(StructureSieve, "_chain_r", counted)
    c_new = c_ref = 0
    for sv, leaves in _sieves(t0_signature):
        calls[0] = 0
        refs = [sv.values_r_numpy(leaves) for _ in range(3)]
        c_ref, calls[0] = c_ref + calls[0], 0
        got = [sv.values_r(leaves) for _ in range(3)]
        c_new += calls[0]
        assert all(g.tolist() == refs[0].tolist() for g in got)
    assert c_ref > 0 and c_new * 3 < c_ref, (c_new, c_ref)


@needs_cc
def test_needed_in_c_marks_what_numpy_marks(fresh, t0_signature):
    """``values_p``' marking in C (``_needed``) picks, per group, the positions numpy's masks
    (``_needed_numpy``) hold, and ``values_p`` then gives ``values``' p parts at the marked
    nodes and 0 elsewhere."""
    compared = 0
    for sv, leaves in _sieves(t0_signature):
        vp_all, vr_all = sv.values(leaves)
        vr = sv.values_r(leaves)
        for nodes in (sv.roots[:3], sv.roots[::7], sv.roots[-1:]):
            before = sv.p_native
            got = sv._needed(nodes)
            assert sv.p_native == before + 1
            ref = sv._needed_numpy(nodes)
            assert [None if m is None else np.flatnonzero(m).tolist() for m in ref] == \
                [None if m is None else m.tolist() for m in got]
            vp = sv.values_p(leaves, vr, nodes)
            marked = np.zeros(sv.n, bool)
            for (_, _, out, _, _), m in zip(sv.groups, got):
                if m is not None:
                    marked[out[m]] = True
            assert marked[nodes].all()
            assert vp[marked].tolist() == vp_all[marked].tolist()
            assert not vp[~marked & ~np.isin(np.arange(sv.n), sv.in_pos)].any()
            compared += int(marked.sum())
    assert compared > 1000
