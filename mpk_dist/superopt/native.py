"""Small C loops for the superoptimizer's hottest numpy steps, compiled at first use.

The C source below is compiled once with the system C compiler (``cc``, or ``$CC``) into
``cache_dir()/native`` (a file named by the hash of the source and the compiler command, written
under a temporary name and renamed, so concurrent processes never load half a file) and loaded
with ``ctypes``. When no compiler is found, the build fails or ``MPK_SUPEROPT_NATIVE=0`` is set,
``library()`` returns None and callers keep their numpy path, which is also the reference the
tests compare the C loops with (tests/superopt/test_native.py).

What is here: ``sieve_bin_r``, the r parts of one binary group of ``sieve.StructureSieve``
(``values_r``): per element, the operands' r parts gathered, added or multiplied modulo r, and
scattered to the result's position; ``sieve_find``, the roots whose r part is the wanted one
(``StructureSieve.matches``' ``np.flatnonzero(vr[roots] == want)`` in one pass); ``sieve_need``,
``values_p``' marking of the structures under the matching roots, group by group. NOTE: numpy runs that as five passes over the group (two
gathers, the operation, the remainder, the scatter) with int32 temporaries; for qk_norm_rope's
lanes (360,405 structures in 25 groups) ``values_r`` took 3.5 ms per new input set, ~30% of a
lane's time per first op (twentieth and twenty-first sessions).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess

SOURCE = r"""
#include <stdint.h>

/* v[out[i]] = (v[a[i]] + v[b[i]]) % r  (add != 0)  or  v[a[i]] * v[b[i]] % r  (add == 0),
   for i < n; operands lie below the results (other positions), values are in [0, r).
   The constant 32749 (sieve.R15) gets its own loops so that the compiler replaces the
   division by a multiplication. */
#define LOOP(R) \
    if (add) { for (int64_t i = 0; i < n; i++) \
                   v[out[i]] = (int32_t)(((int64_t)v[a[i]] + v[b[i]]) % (R)); } \
    else     { for (int64_t i = 0; i < n; i++) \
                   v[out[i]] = (int32_t)(((int64_t)v[a[i]] * v[b[i]]) % (R)); }

void sieve_bin_r(int32_t *v, const int32_t *out, const int32_t *a, const int32_t *b,
                 int64_t n, int32_t add, int32_t r) {
    if (r == 32749) { LOOP(32749) } else { LOOP(r) }
}

/* One group of values_p's marking, results before operands: for every i < n (ascending) whose
   result is needed (need[out[i]] != 0) its operands become needed and i is written to pick;
   returns the number of such i. */
int64_t sieve_need(uint8_t *need, const int32_t *out, const int32_t *a, const int32_t *b,
                   int64_t n, int64_t *pick) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++)
        if (need[out[i]]) { need[a[i]] = 1; need[b[i]] = 1; pick[k++] = i; }
    return k;
}

/* The positions i < n (ascending) with v[roots[i]] == want, written to cand; their number. */
int64_t sieve_find(const int32_t *v, const int32_t *roots, int64_t n, int32_t want,
                   int64_t *cand) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++)
        if (v[roots[i]] == want) cand[k++] = i;
    return k;
}
"""

_STATE: dict = {}  # "lib": the loaded library or None once tried


def _compiler() -> list | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return [cc, "-O2", "-shared", "-fPIC"] if cc else None


def library():
    """The loaded C library (``ctypes.CDLL``) with ``sieve_bin_r`` typed, or None (no compiler,
    a failed build, or ``MPK_SUPEROPT_NATIVE=0``). Tried once per process."""
    if "lib" in _STATE:
        return _STATE["lib"]
    _STATE["lib"] = None
    if os.environ.get("MPK_SUPEROPT_NATIVE", "1") == "0":
        return None
    cmd = _compiler()
    if cmd is None:
        return None
    from mpk_dist.superopt.search import cache_dir  # late: search imports this package's modules

    tag = hashlib.sha256((SOURCE + " ".join(cmd)).encode()).hexdigest()[:16]
    folder = cache_dir() / "native"
    path = folder / f"superopt_{tag}.so"
    try:
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            src = folder / f"superopt_{tag}.{os.getpid()}.c"
            tmp = folder / f"superopt_{tag}.{os.getpid()}.so"
            src.write_text(SOURCE)
            try:
                subprocess.run([*cmd, "-o", str(tmp), str(src)], check=True,
                               capture_output=True, timeout=120)
                os.replace(tmp, path)
            finally:
                src.unlink(missing_ok=True)
                tmp.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None
    ptr = ctypes.c_void_p
    lib.sieve_bin_r.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int64, ctypes.c_int32,
                                ctypes.c_int32]
    lib.sieve_bin_r.restype = None
    lib.sieve_find.argtypes = [ptr, ptr, ctypes.c_int64, ctypes.c_int32, ptr]
    lib.sieve_find.restype = ctypes.c_int64
    lib.sieve_need.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int64, ptr]
    lib.sieve_need.restype = ctypes.c_int64
    _STATE["lib"] = lib
    return lib
