"""The fusable LLM subgraphs the CLI and the mega-kernel ask the superoptimizer about.

Each builder returns a target Graph at the given shapes. Defaults are decode shapes of a
Qwen3-8B-like layer (one tensor-parallel shard where it matters).

  rmsnorm_linear    X (M, K), G (K,), W (K, N):   rms_norm(X, G) @ W
  silu_mul_linear   A (M, I), B (M, I), W (I, N): (silu(A) * B) @ W
  attention_decode  Q (H, D), Kt (D, S), V (S, D): softmax(Q Kt * D^-0.5) V, one KV head's
                    query group; the K cache is stored transposed (D, S) so no transpose op is
                    needed; softmax as exp / sum(exp) (scores of decode stay small)
  qk_norm_rope      Q (H, D), G (D,), C (D,), S (D,), R (D, D): n = rms_norm(Q, G);
                    n * C + (n @ R) * S, R the rotate-half matrix (rope as a matmul by a signed
                    permutation, so the op set stays primitive)
"""

from __future__ import annotations

from mpk_dist.errors import MpkError
from mpk_dist.superopt.graph import Graph

DEFAULT_SHAPES = {
    "rmsnorm_linear": {"M": 8, "K": 4096, "N": 1024},
    "silu_mul_linear": {"M": 8, "I": 1536, "N": 1024},
    "attention_decode": {"H": 4, "D": 128, "S": 4096},
    "qk_norm_rope": {"H": 32, "D": 128},
}


def rmsnorm_linear(M: int, K: int, N: int, eps: float = 1e-6) -> Graph:
    """rms_norm(X, G, eps) @ W."""
    g = Graph()
    x, w_norm, w = g.input("X", (M, K)), g.input("G", (K,)), g.input("W", (K, N))
    g.output(g.matmul(g.rms_norm(x, w_norm, eps), w))
    return g


def silu_mul_linear(M: int, I: int, N: int) -> Graph:  # noqa: E741 (I: intermediate size)
    """(silu(A) * B) @ W: the gate/up product feeding the down projection."""
    g = Graph()
    a, b, w = g.input("A", (M, I)), g.input("B", (M, I)), g.input("W", (I, N))
    g.output(g.matmul(g.mul(g.silu(a), b), w))
    return g


def attention_decode(H: int, D: int, S: int) -> Graph:
    """softmax(Q @ Kt / sqrt(D)) @ V for one KV head and its H query heads."""
    g = Graph()
    q, kt, v = g.input("Q", (H, D)), g.input("Kt", (D, S)), g.input("V", (S, D))
    e = g.exp(g.mul(g.matmul(q, kt), float(D) ** -0.5))
    g.output(g.matmul(g.div(e, g.sum(e, 1)), v))
    return g


def qk_norm_rope(H: int, D: int, eps: float = 1e-6) -> Graph:
    """rms_norm over each head's D features, then rope: n*C + (n@R)*S."""
    g = Graph()
    q, w = g.input("Q", (H, D)), g.input("G", (D,))
    cos, sin, rot = g.input("C", (D,)), g.input("S", (D,)), g.input("R", (D, D))
    n = g.rms_norm(q, w, eps)
    g.output(g.add(g.mul(n, cos), g.mul(g.matmul(n, rot), sin)))
    return g


PATTERNS = {"rmsnorm_linear": rmsnorm_linear, "silu_mul_linear": silu_mul_linear,
            "attention_decode": attention_decode, "qk_norm_rope": qk_norm_rope}


def build(name: str, shape: dict | None = None) -> Graph:
    """The target Graph of pattern ``name`` with ``shape`` overriding the default sizes."""
    if name not in PATTERNS:
        raise MpkError(f"superopt pattern: expected one of {sorted(PATTERNS)}, got {name!r}")
    dims = dict(DEFAULT_SHAPES[name])
    for k, v in (shape or {}).items():
        if k not in dims:
            example = ",".join(f"{a}={b}" for a, b in dims.items())
            raise MpkError(f"superopt --shape for {name}: expected keys among {sorted(dims)}, "
                           f"got {k!r}; e.g. --shape {example}")
        if not isinstance(v, int) or v < 1:
            raise MpkError(f"superopt --shape {k}: expected a positive int, got {v!r}")
        dims[k] = v
    return PATTERNS[name](**dims)
