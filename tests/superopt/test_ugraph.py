"""µGraph IR: a hand-built block graph evaluates exactly as written (maps, loops, accumulators)."""

import numpy as np
import pytest

from mpk_dist.superopt import GraphError
from mpk_dist.superopt import expr as E
from mpk_dist.superopt.cost import graph_cost
from mpk_dist.superopt.ugraph import (STACK, Accumulator, BlockGraph, BlockInput, BlockOp,
                                      BlockOutput, KernelOp, TensorInfo, UGraph)


def _info(shape):
    return TensorInfo(shape, (None,) * len(shape), E.var("?"))


def split_k_matmul(M=4, K=32, N=8, grid=(("n", 2), ("k", 2)), loop=4):
    """Y_partial[g] = X[:, k-half g] @ W[k-half g, n-tile], loop over the rest of k."""
    kt = K // grid[1][1]
    body = (BlockOp("matmul", ("i0", "i1"), "b0", _info((M, N // 2))),)
    bg = BlockGraph(
        grid=grid, loop=("k", loop),
        inputs=(BlockInput("X", "i0", (None, 1), 1, (M, kt)),
                BlockInput("W", "i1", (1, 0), 0, (kt, N // 2))),
        body=body, accs=(Accumulator("b0", "a0", "sum", _info((M, N // 2))),), post=(),
        outputs=(BlockOutput("a0", "P", (1, STACK)),))
    tensors = {"X": _info((M, K)), "W": _info((K, N)), "P": _info((2, M, N)),
               "Y": _info((M, N))}
    ops = [KernelOp("custom", ("X", "W"), ("P",), block=bg),
           KernelOp("sum", ("P",), ("Y",), (("dim", 0), ("keepdim", False)))]
    return UGraph({"X": tensors["X"], "W": tensors["W"]}, ops, tensors, "Y")


def test_split_k_block_graph_evaluates_to_the_matmul():
    ug = split_k_matmul()
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 32)), rng.standard_normal((32, 8))
    (y,) = ug.evaluate({"X": x, "W": w})
    assert np.allclose(y, x @ w)


def test_wrong_accumulator_changes_the_result():
    ug = split_k_matmul()
    op = ug.kernel_ops[0]
    from dataclasses import replace

    bad = replace(op.block, accs=(replace(op.block.accs[0], kind="last"),))
    ug2 = ug.with_kernel_ops([replace(op, block=bad), ug.kernel_ops[1]])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 32)), rng.standard_normal((32, 8))
    assert not np.allclose(ug2.evaluate({"X": x, "W": w})[0], x @ w)


def test_text_form_smem_and_cost():
    ug = split_k_matmul()
    ug.cost = graph_cost(ug)
    text = str(ug)
    for piece in ("custom(X, W)", "grid=(n/2, k/2)", "loop=k/4", "imap=[φ,1]", "fmap=1",
                  "acc a0 = sum(b0)", "omap=[1,stack]", "sum[dim=0,drop](P)", "output Y"):
        assert piece in text, piece
    bg = ug.kernel_ops[0].block
    # per iteration: X tile 4x4, W tile 4x4, matmul 4x4, accumulator 4x4 (bf16)
    assert bg.smem_bytes() == (16 + 16 + 16 + 16) * 2
    assert ug.cost["sync_points"] == 2 and ug.cost["time_us"] > 4.0


def test_evaluate_checks_its_feeds():
    ug = split_k_matmul()
    with pytest.raises(GraphError, match="got none for"):
        ug.evaluate({"X": np.zeros((4, 32))})
    with pytest.raises(GraphError, match="of shape"):
        ug.evaluate({"X": np.zeros((4, 31)), "W": np.zeros((32, 8))})
