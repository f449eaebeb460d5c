"""The target Graph builder: primitives, composites, shapes, errors."""

import pytest

from mpk_dist.errors import MpkError
from mpk_dist.superopt import Graph, GraphError
from mpk_dist.superopt.graph import PRIMITIVES


def test_composites_expand_to_primitives():
    g = Graph()
    x, w = g.input("X", (2, 8)), g.input("G", (8,))
    g.output(g.mul(g.silu(g.rms_norm(x, w, 1e-5)), g.square(g.mean(x, 1))))
    assert {n.op for n in g.nodes} <= set(PRIMITIVES)
    assert {n.op for n in g.nodes} >= {"sqrt", "exp", "div", "sum"}
    origins = {n.origin for n in g.nodes}
    assert {"rms_norm#0", "silu#0", "square#0", "mean#0"} <= origins


def test_shapes_follow_matmul_broadcasting_and_keepdim_sums():
    g = Graph()
    x, w = g.input("X", (4, 16)), g.input("W", (16, 8))
    y = g.matmul(x, w)
    s = g.sum(y, 1)
    assert y.shape == (4, 8) and s.shape == (4, 1)
    assert g.div(y, s).shape == (4, 8)


@pytest.mark.parametrize("build, message", [
    (lambda g: g.matmul(g.input("A", (2, 3)), g.input("B", (4, 5))), "matmul: expected"),
    (lambda g: g.add(g.input("A", (2, 3)), g.input("B", (2, 4))), "add: expected broadcastable"),
    (lambda g: g.sum(g.input("A", (2, 3)), 2), "sum: expected dim"),
    (lambda g: g.input("A", (0, 3)), "expected a shape of positive ints"),
    (lambda g: (g.input("A", (2,)), g.input("A", (2,))), "duplicate"),
    (lambda g: g.exp(Graph().input("B", (2,))), "expected a Tensor of this Graph"),
])
def test_bad_graphs_raise_one_line_errors(build, message):
    with pytest.raises(GraphError, match=message) as info:
        build(Graph())
    assert isinstance(info.value, MpkError) and "\n" not in str(info.value)


def test_exactly_one_output_required():
    g = Graph()
    g.input("A", (2,))
    with pytest.raises(GraphError, match="expected exactly 1"):
        g.check()
