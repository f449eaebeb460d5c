"""GPU test of the row pools (mpk_dist/runtime/row_pool.py, csrc/tasks/row_pool.cuh): with MPK_ROW_POOL the wide
batch-1 levels' last rows are summed by whichever tile claims them, each row still one warp's sum in the same order,
so the logits equal the unpooled records' bit for bit (the same binary), and every claim counter is back at zero
after the launch (the step's last claim resets it).

- qwen3-0.6b batch 1 at its default 256 threads: the gate|up pair tiles pool (o_proj's and down's 8-row tiles are
  one chunk, so they keep their rows).
- the same at 128 threads (chunks of 4 rows): o_proj and down (linear_residual) pool too.

Run: ``python -m pytest -q -m gpu tests/runtime/test_row_pool_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.runtime.testing import check_bitwise, forced_request, megakernel_with_env  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
NAME = "qwen3-0.6b"
PROMPT = 200
STEPS = 48


def _pooled_kinds(sess) -> set[str]:
    from mpk_dist.runtime.task_records import REC_POOL_TILES
    from mpk_dist.taskgraph.abi import TASK_COLS

    rec = sess.records.cpu().numpy()
    tasks = rec[rec[:, REC_POOL_TILES] > 0, 0]  # REC_TASK
    ops = sess.cg.arrays["tasks"][tasks, TASK_COLS["OP_INDEX"]]
    return {sess.cg.meta["ops"][int(o)]["name"].split(".")[-1] for o in np.unique(ops)}


@pytest.mark.parametrize("threads,percent,kinds", [
    ("", "30", {"gate_up_proj"}),
    ("128", "50", {"gate_up_proj", "o_proj", "down_proj"}),
], ids=["t256-gate_up", "t128-all"])
def test_row_pool_leaves_the_logits_bitwise(threads, percent, kinds, gpu_results):
    base_env = {"MPK_WORKER_THREADS": threads} if threads else {}
    pooled = megakernel_with_env(NAME, {**base_env, "MPK_ROW_POOL": percent})
    plain = megakernel_with_env(NAME, base_env)
    sess = pooled.session(1)
    assert sess.build.path == plain.session(1).build.path, "the row pool is a record-level switch: the same binary"
    assert _pooled_kinds(sess) == kinds, _pooled_kinds(sess)
    assert not _pooled_kinds(plain.session(1))
    check_bitwise(f"MPK_ROW_POOL={percent} vs none, {NAME} b1 t{threads or 'default'} prompt {PROMPT}", NAME, pooled,
                  plain, forced_request(NAME, PROMPT, STEPS, 1, 70), gpu_results)
    torch.cuda.synchronize()
    assert not sess.pool_counters.cpu().any(), "a claim counter was left non-zero after the launch"
