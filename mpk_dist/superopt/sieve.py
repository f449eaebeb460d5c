"""The last op's cheap test over all output structures of a signature at once (numpy).

``blockshare.SharedFinal`` tests each concrete input set of a last-op layout by the stripped
fingerprint of every output structure of the layout's signature (``StrippedTable.value``:
``Fingerprint(sized=False)`` computed node by node in Python, 61-bit values). For qk_norm_rope's
5-input signatures that is ~3 x 10^5 structure values, ~0.7 s, per new stripped input set
(docs/SUPEROPT.md, fifteenth session), and it was most of a lane's time.

``StructureSieve`` compiles the structures a signature reaches into a few numpy index arrays
(grouped by height and op kind) once, and evaluates them for an input set with one vectorized
step per group, in a second fingerprint of the same construction over a 31-bit prime
(``FIELD31``: products of two values fit in int64). The structures whose 31-bit value is not the
target's are dropped; the others (a handful) still get the 61-bit test of ``StrippedTable``, and
every graph that passes that gets the exact test (``blockshare._concrete_verdict``).

Why the kept graphs are exactly the same: both fingerprints are built by the same code
(``blockmemo.Fingerprint``, ``field`` only changes the constants p = 2 R Q + 1, W of order R, K
with K = 1 mod 2R and K = -1 mod Q), so every rewrite of ``expr.normalize`` holds for both: a
graph whose output's stripped expression equals the target's has equal fingerprints in both
fields. The 31-bit test is therefore a necessary condition of the exact test, like the 61-bit one,
and a graph it drops would have failed the exact test. It only lets through more false matches
(about one structure in 2^15 whose r parts collide), which the 61-bit test then drops as before.

Since the twentieth session ``matches`` computes the r parts of every structure first (no p part
enters an r part) and the p parts only under the roots whose r part is the wanted one: the same
array, without x**K and W**b for almost every structure (``StructureSieve.matches``).

Since the twenty-first session the r parts' add / mul / div groups and the search for the roots
with the wanted r part run in C when a compiler is at hand (``native``), with the numpy code
kept as the fallback and as the tests' reference.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.superopt import expr as E
from mpk_dist.superopt import native
from mpk_dist.superopt.field import _vpow

# p = 2*R*Q + 1 (prime, 31 bits; R = 32749 and Q = 32609 primes), W of order R in Z_p*, K with
# K = 1 mod 2R and K = -1 mod Q: blockmemo's construction (P61, R30, W61, K61) under 2^31, so
# that (p - 1)^2 < 2^62 and every product of two values is exact in int64.
P31 = 2135824283
R15 = 32749
W31 = 1175230284
K31 = 1357773541
FIELD31 = (P31, R15, W31, K31)


class StructureSieve:
    """The structures ``roots`` of a ``StrippedTable`` (and every structure under them) compiled
    for vectorized evaluation of ``fp`` (a ``Fingerprint(sized=False, field=FIELD31)``).

    ``matches(leaves, want)``: a bool array over ``roots`` (in their order), True where the
    structure's fingerprint for the concrete inputs' fingerprints ``leaves`` (by input position)
    is ``want``: the same values as a ``StrippedTable`` over ``fp`` gives, for all roots at once
    (tests/superopt/test_sieve.py compares them)."""

    def __init__(self, table, roots: list, fp) -> None:
        self.fp = fp
        order, local = _post_order(table.defs, roots)
        height = [0] * len(order)
        groups: dict = {}
        in_pos, in_k = [], []
        for i, sid in enumerate(order):
            d = table.defs[sid]
            if d[0] == "in":
                in_pos.append(i)
                in_k.append(d[1])
                continue
            kind, attrs, args = d
            loc = [local[a] for a in args]
            height[i] = 1 + max(height[j] for j in loc)
            # mul, add, div are the table's binary forms; anything else is a chain program
            code = kind if kind in ("mul", "add", "div") else ("chain", id(attrs["prog"]))
            g = groups.setdefault((height[i], code), [attrs.get("prog"), [], [], []])
            g[1].append(i)
            g[2].append(loc[0])
            g[3].append(loc[-1])
        self.n = len(order)
        self.in_pos, self.in_k = np.array(in_pos, np.int32), np.array(in_k, np.int32)
        # evaluated by height: every operand has a smaller height than its result
        self.groups = [(code if isinstance(code, str) else "chain", prog,
                        np.array(out, np.int32), np.array(a, np.int32), np.array(b, np.int32))
                       for (_, code), (prog, out, a, b) in sorted(groups.items(),
                                                                   key=lambda kv: kv[0][0])]
        self.roots = np.array([local[r] for r in roots], np.int32)
        self.nbytes = sum(x.nbytes for g in self.groups for x in g[2:]) + self.roots.nbytes
        self.p_computed = 0  # structures whose p part ``values_p`` computed, over all calls
        self.r_native = 0    # ``values_r`` calls that ran in C
        self.chain_tables: dict = {}  # id(prog) -> (prog, ``_chain_table``)
        self.p_native = 0    # ``_needed`` calls that ran in C

    def values(self, leaves: tuple) -> tuple:
        """(p parts, r parts) of every compiled structure's fingerprint for ``leaves``."""
        f = self.fp
        vp, vr = np.zeros(self.n, np.int64), np.zeros(self.n, np.int64)
        lp = np.array([x[0] for x in leaves], np.int64)
        lr = np.array([x[1] for x in leaves], np.int64)
        vp[self.in_pos], vr[self.in_pos] = lp[self.in_k], lr[self.in_k]
        for code, prog, out, a, b in self.groups:
            x = (vp[a], vr[a])
            if code == "chain":
                y = self._chain(prog, x)
            else:
                y = self._binary(code, x, (vp[b], vr[b]))
            vp[out], vr[out] = y
        return vp, vr

    def matches(self, leaves: tuple, want: tuple) -> np.ndarray:
        """True per root whose fingerprint for ``leaves`` is ``want``: the same array as
        ``values`` gives (``matches_full``), computed in two steps.

        The r parts first, for every structure (``values_r``): add and mul act on them alone,
        inv is the identity there, exp sets them to 1 and sqrt is a cubic of the r part, so no r
        part reads a p part and these are the r parts ``values`` computes. Only the roots whose r
        part is ``want``'s can match; the p parts are then computed for them and the structures
        under them (``values_p``, by the same operations as ``values``, which read the operands'
        p and r parts), and a root matches when both parts are ``want``'s.

        NOTE: the p parts were most of the work: inv is x**K (``_pow_k``: 31 squarings and 19
        products per element) and exp a power of W, per element of every div and exp group, for
        all ~10^5 structures of a signature, to keep almost none (qk_norm_rope's lanes: 26 ms per
        new input set, 73% of a lane's time per first op, twentieth session)."""
        vr = self.values_r(leaves)
        roots = self.roots
        lib = native.library()
        if lib is None:
            cand = np.flatnonzero(vr[roots] == want[1])
        else:  # the same ascending positions, without the gathered copy and the bool array
            cand = np.empty(len(roots), np.int64)
            cand = cand[:lib.sieve_find(vr.ctypes.data, roots.ctypes.data, len(roots),
                                        want[1], cand.ctypes.data)]
        out = np.zeros(len(roots), bool)
        if cand.size:
            vp = self.values_p(leaves, vr, roots[cand])
            out[cand] = vp[roots[cand]] == want[0]
        return out

    def matches_full(self, leaves: tuple, want: tuple) -> np.ndarray:
        """``matches`` from every structure's whole value (``values``; the former ``matches``,
        kept for the tests' comparison)."""
        vp, vr = self.values(leaves)
        return (vp[self.roots] == want[0]) & (vr[self.roots] == want[1])

    def values_r(self, leaves: tuple) -> np.ndarray:
        """The r parts of every compiled structure's fingerprint for ``leaves`` (``values``'s
        second array), as int32: r parts are below R15 < 2^15, so a product of two (and the
        cubic's Horner steps) stays below 2^31 (1.7x faster than int64 in a micro-benchmark of
        one gather, product and remainder).

        The add, mul and div groups run in C (``native.library``'s ``sieve_bin_r``: the same
        sums and products modulo r, element by element, in the groups' order) when it is
        available, else in numpy (``values_r_numpy``, the reference of
        tests/superopt/test_native.py); chain groups (a few thousand structures) stay in numpy.
        NOTE: 3.5 ms -> ~0.6 ms per call on qk_norm_rope's lane signature (360,405 structures;
        twenty-first session)."""
        lib = native.library()
        if lib is None:
            return self.values_r_numpy(leaves)
        r = self.fp.q
        assert (r - 1) ** 2 + r < 2 ** 31
        vr = np.zeros(self.n, np.int32)
        vr[self.in_pos] = np.array([x[1] for x in leaves], np.int32)[self.in_k]
        at = vr.ctypes.data
        for code, prog, out, a, b in self.groups:
            if code == "chain":
                vr[out] = self._chain_table(prog)[vr[a]]
            else:  # div as mul: inv is the identity on the r part
                lib.sieve_bin_r(at, out.ctypes.data, a.ctypes.data, b.ctypes.data, len(out),
                                code == "add", r)
        self.r_native += 1
        return vr

    def values_r_numpy(self, leaves: tuple) -> np.ndarray:
        """``values_r`` in numpy alone (the path without the C library, and its reference)."""
        r = self.fp.q
        assert (r - 1) ** 2 + r < 2 ** 31
        vr = np.zeros(self.n, np.int32)
        vr[self.in_pos] = np.array([x[1] for x in leaves], np.int32)[self.in_k]
        for code, prog, out, a, b in self.groups:
            if code == "chain":
                vr[out] = self._chain_r(prog, vr[a])
            elif code == "add":
                vr[out] = (vr[a] + vr[b]) % r
            else:  # mul, and div: inv is the identity on the r part
                vr[out] = vr[a] * vr[b] % r
        return vr

    def values_p(self, leaves: tuple, vr: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """The p parts of the structures at positions ``nodes`` and of every structure under
        them, for ``leaves`` whose r parts are ``vr`` (``values_r``); other positions hold 0.
        Each group computes its needed elements as ``values`` does (``_chain`` / ``_binary`` on
        the operands' p and r parts). The groups' needed elements come from ``_needed``."""
        picks = self._needed(nodes)
        vp = np.zeros(self.n, np.int64)
        lp = np.array([x[0] for x in leaves], np.int64)
        vp[self.in_pos] = lp[self.in_k]
        for (code, prog, out, a, b), m in zip(self.groups, picks):
            if m is None:
                continue
            a, b = a[m], b[m]
            # int64 r parts, as ``values`` has them (``_exp`` starts its powers from them)
            x = (vp[a], vr[a].astype(np.int64))
            y = self._chain(prog, x) if code == "chain" else \
                self._binary(code, x, (vp[b], vr[b].astype(np.int64)))
            vp[out[m]] = y[0]
            self.p_computed += len(a)
        return vp

    def _needed(self, nodes: np.ndarray) -> list:
        """Per group, the positions in the group (ascending; None: none) of the structures at
        ``nodes`` and of every structure under them: results marked before their operands, the
        groups from the highest down (operands sit in lower groups). In C when the library is
        there (``native``'s ``sieve_need``: the same marks in one pass per group), else numpy
        (``_needed_numpy``). NOTE: the marking was ~0.7 of a ~1.4 ms ``values_p`` on the
        qk_norm_rope lane signature (twenty-first session)."""
        lib = native.library()
        if lib is None:
            return self._needed_numpy(nodes)
        need = np.zeros(self.n, np.uint8)
        need[nodes] = 1
        picks = [None] * len(self.groups)
        buf = np.empty(max((len(g[2]) for g in self.groups), default=0), np.int64)
        for g in range(len(self.groups) - 1, -1, -1):
            _, _, out, a, b = self.groups[g]
            k = lib.sieve_need(need.ctypes.data, out.ctypes.data, a.ctypes.data, b.ctypes.data,
                               len(out), buf.ctypes.data)
            if k:
                picks[g] = buf[:k].copy()
        self.p_native += 1
        return picks

    def _needed_numpy(self, nodes: np.ndarray) -> list:
        """``_needed`` in numpy (the reference), as bool masks over each group."""
        need = np.zeros(self.n, bool)
        need[nodes] = True
        picks = [None] * len(self.groups)
        for g in range(len(self.groups) - 1, -1, -1):  # operands sit in lower groups
            _, _, out, a, b = self.groups[g]
            m = need[out]
            if m.any():
                picks[g] = m
                need[a[m]] = True
                need[b[m]] = True
        return picks

    def _binary(self, code: str, x: tuple, y: tuple) -> tuple:
        p, r = self.fp.p, self.fp.q
        if code == "add":
            return (x[0] + y[0]) % p, (x[1] + y[1]) % r
        if code == "div":  # mul by inv: x**K on the p part, the identity on the r part
            y = (self._pow_k(y[0]), y[1])
        return x[0] * y[0] % p, x[1] * y[1] % r

    def _pow_k(self, x: np.ndarray) -> np.ndarray:
        """x ** K mod p, elementwise (``Fingerprint.inv``'s p part)."""
        return _vpow(x, self.fp.k, self.fp.p)

    def _exp(self, x: tuple) -> tuple:
        """W ** (r part) mod p, r part 1 (``Fingerprint.exp``)."""
        p, e = self.fp.p, x[1]
        out, w = np.ones_like(e), self.fp.w
        for bit in range(int(e.max(initial=0)).bit_length()):
            out = np.where((e >> bit) & 1, out * w % p, out)
            w = w * w % p
        return out, np.ones_like(e)

    def _sqrt(self, x: tuple) -> tuple:
        """The fixed random cubic of each part (``Fingerprint.sqrt``), Horner step by step."""
        out = []
        for v, c, m in ((x[0], self.fp.sqrt_p, self.fp.p), (x[1], self.fp.sqrt_q, self.fp.q)):
            acc = np.full_like(v, c[3])
            for coef in (c[2], c[1], c[0]):
                acc = (acc * v % m + coef) % m
            out.append(acc)
        return tuple(out)

    def _chain_table(self, prog) -> np.ndarray:
        """``_chain_r(prog, x)`` for every r part x in [0, r), as a table (built once per
        program). Exact: a chain program acts element by element (constants, sums, products,
        exp's 1 and the cubic), and every r part is in [0, r), so ``table[x]`` is
        ``_chain_r(prog, x)``. NOTE: the chain groups' recursion over small arrays was ~0.23 ms
        of a 0.9 ms ``values_r`` (twenty-first session)."""
        hit = self.chain_tables.get(id(prog))
        if hit is None or hit[0] is not prog:
            x = np.arange(self.fp.q, dtype=np.int32)
            hit = self.chain_tables[id(prog)] = (prog, self._chain_r(prog, x))  # keeps prog alive
        return hit[1]

    def _chain_r(self, prog, x: np.ndarray) -> np.ndarray:
        """The r part of a chain program on arrays (``_chain``'s second array, from r parts
        alone: exp's is 1, inv's is its operand's)."""
        r = self.fp.q
        if prog == "x":
            return x
        if isinstance(prog, float):
            return np.full_like(x, self.fp.atom(E.const(prog))[1])
        op, *args = prog
        sub = [self._chain_r(a, x) for a in args]
        if op == "add":
            return (sub[0] + sub[1]) % r
        if op in ("mul", "div"):
            return sub[0] * sub[1] % r
        if op == "exp":
            return np.ones_like(x)
        c, acc = self.fp.sqrt_q, np.full_like(sub[0], self.fp.sqrt_q[3])
        for coef in (c[2], c[1], c[0]):  # as ``_sqrt``
            acc = (acc * sub[0] % r + coef) % r
        return acc

    def _chain(self, prog, x: tuple) -> tuple:
        """A chain program on arrays (``Fingerprint.chain``)."""
        if prog == "x":
            return x
        if isinstance(prog, float):
            c = self.fp.atom(E.const(prog))
            return np.full_like(x[0], c[0]), np.full_like(x[1], c[1])
        op, *args = prog
        sub = [self._chain(a, x) for a in args]
        if op in ("add", "mul", "div"):
            return self._binary(op, sub[0], sub[1])
        return {"exp": self._exp, "sqrt": self._sqrt}[op](sub[0])


def _post_order(defs: list, roots: list) -> tuple:
    """(structure ids reachable from ``roots``, operands first; {id: position})."""
    local: dict = {}
    order: list = []
    for root in roots:
        stack = [(root, False)]
        while stack:
            sid, ready = stack.pop()
            if sid in local:
                continue
            if ready:
                local[sid] = len(order)
                order.append(sid)
                continue
            stack.append((sid, True))
            d = defs[sid]
            if d[0] != "in":
                stack.extend((a, False) for a in d[2] if a not in local)
    return order, local
