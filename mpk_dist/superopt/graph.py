"""The target computation: a small tensor program built op by op.

``Graph`` is what the user hands to ``superoptimize``. Composite ops (silu, square, mean,
rms_norm) expand into the primitives matmul, add, mul, div, exp, sqrt and sum, so the search and the
verifier only know those. Reductions keep the reduced dimension with size 1 (broadcasting then
works as in numpy). Every node remembers the user-level op it came from (``origin``), which the
µGraph printer and the code generator use to name what a fused block op implements.

Shapes: matmul takes (..., M, K) @ (K, N); element-wise ops broadcast like numpy; a scalar (a
Python float) may stand on either side of add/mul/div.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpk_dist.errors import MpkError


class GraphError(MpkError):
    """A target graph is malformed (bad shapes, unknown tensor, missing output)."""


PRIMITIVES = ("input", "const", "matmul", "add", "mul", "div", "exp", "sqrt", "sum")
ELEMENTWISE = ("add", "mul", "div", "exp", "sqrt")


@dataclass(frozen=True)
class Tensor:
    """A handle on one node of a ``Graph`` (what the builder methods return)."""

    graph_id: int
    index: int
    shape: tuple


@dataclass
class Node:
    """One primitive op of the target: ``op`` applied to ``inputs`` (node indices)."""

    op: str
    inputs: tuple
    shape: tuple
    attrs: dict = field(default_factory=dict)
    origin: str = ""


def broadcast_shape(a: tuple, b: tuple) -> tuple | None:
    """numpy broadcasting of two shapes, or None when they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(reversed(out))


def matmul_shape(a: tuple, b: tuple) -> tuple | None:
    """Shape of (..., M, K) @ (K, N), or None when the inner sizes differ."""
    if len(a) < 2 or len(b) != 2 or a[-1] != b[0]:
        return None
    return a[:-1] + (b[1],)


class Graph:
    """Builder of a target computation (see the module docstring for the op set)."""

    _next_id = 0

    def __init__(self) -> None:
        Graph._next_id += 1
        self.id = Graph._next_id
        self.nodes: list[Node] = []
        self.outputs: list[int] = []
        self._origin_stack: list[str] = []
        self._counts: dict[str, int] = {}

    # -- plumbing ---------------------------------------------------------------------------
    def _origin(self, name: str) -> str:
        if self._origin_stack:
            return self._origin_stack[-1]
        n = self._counts.get(name, 0)
        self._counts[name] = n + 1
        return f"{name}#{n}"

    def _add(self, op: str, inputs: tuple, shape: tuple, origin: str, **attrs) -> Tensor:
        self.nodes.append(Node(op, inputs, tuple(shape), attrs, origin))
        return Tensor(self.id, len(self.nodes) - 1, tuple(shape))

    def _ref(self, t, what: str) -> int:
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            return self._add("const", (), (), "const", value=float(t)).index
        if not isinstance(t, Tensor) or t.graph_id != self.id:
            raise GraphError(f"{what}: expected a Tensor of this Graph or a float, got {t!r}; "
                             "build every operand with this Graph's methods")
        return t.index

    def _composite(self, name: str):
        graph = self

        class _Scope:
            def __enter__(self):
                graph._origin_stack.append(graph._origin(name))

            def __exit__(self, *exc):
                graph._origin_stack.pop()

        return _Scope()

    # -- primitives -------------------------------------------------------------------------
    def input(self, name: str, shape) -> Tensor:
        """Declare an input tensor ``name`` of the given shape (positive ints)."""
        shape = tuple(int(s) for s in shape)
        if not shape or any(s <= 0 for s in shape):
            raise GraphError(f"input {name!r}: expected a shape of positive ints, got {shape}")
        if any(n.op == "input" and n.attrs["name"] == name for n in self.nodes):
            raise GraphError(f"input {name!r}: expected a new name, got a duplicate; rename it")
        return self._add("input", (), shape, name, name=name)

    def _binary(self, op: str, a, b) -> Tensor:
        ia, ib = self._ref(a, op), self._ref(b, op)
        sa, sb = self.nodes[ia].shape, self.nodes[ib].shape
        shape = broadcast_shape(sa, sb)
        if shape is None:
            raise GraphError(f"{op}: expected broadcastable shapes, got {sa} and {sb}")
        return self._add(op, (ia, ib), shape, self._origin(op))

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """(..., M, K) @ (K, N) -> (..., M, N)."""
        ia, ib = self._ref(a, "matmul"), self._ref(b, "matmul")
        sa, sb = self.nodes[ia].shape, self.nodes[ib].shape
        shape = matmul_shape(sa, sb)
        if shape is None:
            raise GraphError(f"matmul: expected (..., M, K) @ (K, N), got {sa} @ {sb}")
        return self._add("matmul", (ia, ib), shape, self._origin("matmul"))

    def add(self, a, b) -> Tensor:
        """Element-wise a + b (numpy broadcasting; either may be a float)."""
        return self._binary("add", a, b)

    def mul(self, a, b) -> Tensor:
        """Element-wise a * b."""
        return self._binary("mul", a, b)

    def div(self, a, b) -> Tensor:
        """Element-wise a / b."""
        return self._binary("div", a, b)

    def exp(self, a: Tensor) -> Tensor:
        """Element-wise e ** a."""
        i = self._ref(a, "exp")
        return self._add("exp", (i,), self.nodes[i].shape, self._origin("exp"))

    def sqrt(self, a: Tensor) -> Tensor:
        """Element-wise square root."""
        i = self._ref(a, "sqrt")
        return self._add("sqrt", (i,), self.nodes[i].shape, self._origin("sqrt"))

    def sum(self, a: Tensor, dim: int) -> Tensor:
        """Sum over ``dim``, keeping it with size 1."""
        i = self._ref(a, "sum")
        shape = list(self.nodes[i].shape)
        if not -len(shape) <= dim < len(shape):
            raise GraphError(f"sum: expected dim in [{-len(shape)}, {len(shape)}), got {dim}")
        dim %= len(shape)
        shape[dim] = 1
        return self._add("sum", (i,), tuple(shape), self._origin("sum"), dim=dim)

    # -- composites -------------------------------------------------------------------------
    def square(self, a: Tensor) -> Tensor:
        """a * a."""
        with self._composite("square"):
            return self.mul(a, a)

    def silu(self, a: Tensor) -> Tensor:
        """a * sigmoid(a) = a / (1 + exp(-a))."""
        with self._composite("silu"):
            return self.div(a, self.add(self.exp(self.mul(a, -1.0)), 1.0))

    def mean(self, a: Tensor, dim: int) -> Tensor:
        """Mean over ``dim`` (kept with size 1): sum times 1/n."""
        with self._composite("mean"):
            n = a.shape[dim]
            return self.mul(self.sum(a, dim), 1.0 / n)

    def rms_norm(self, a: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        """a / sqrt(mean(a*a, -1) + eps) * weight."""
        with self._composite("rms_norm"):
            ms = self.mean(self.square(a), -1)
            return self.mul(self.div(a, self.sqrt(self.add(ms, float(eps)))), weight)

    def output(self, t: Tensor) -> None:
        """Mark ``t`` as the (single) result the µGraph must compute."""
        self.outputs.append(self._ref(t, "output"))

    # -- queries ----------------------------------------------------------------------------
    def input_names(self) -> list[str]:
        """Names of the inputs, in declaration order."""
        return [n.attrs["name"] for n in self.nodes if n.op == "input"]

    def input_shapes(self) -> dict[str, tuple]:
        """{input name: shape}."""
        return {n.attrs["name"]: n.shape for n in self.nodes if n.op == "input"}

    def check(self) -> None:
        """Raise GraphError unless the graph has exactly one output."""
        if len(self.outputs) != 1:
            raise GraphError(f"graph outputs: expected exactly 1 (call g.output(t) once), "
                             f"got {len(self.outputs)}")

    def signature(self) -> str:
        """A stable text of the whole graph (ops, shapes, constants): the cache key's core."""
        rows = [f"{i}:{n.op}{n.inputs}{n.shape}{sorted(n.attrs.items())}"
                for i, n in enumerate(self.nodes)]
        return ";".join(rows) + f"->{self.outputs}"
