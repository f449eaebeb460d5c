"""GPU tests of split-KV attention (``MegakernelBackend(attn_splits='auto')``), run by
``scripts/gpu_check.sh --attn-split-only``. Same acceptance as tests/runtime/test_megakernel_gpu.py:
>= 256 teacher-forced steps with logits within 3% of the logits' std of the torch reference at every
step and >= 99% argmax agreement. MAX_SEQ 320 and 132 SMs give 5 ranges of 64 positions, so the
first 60 steps have every position inside the first range (the others empty) and the last ones use
all five. Each case runs twice: with the runtime's shared memory as it sizes it (the staged path
of attention_split.cuh) and with the staged path's share withheld (the per-warp path). The cases run the
plain attention_split kind (fused linears only: an explicit fusion list keeps the backend's default
attention fusions off, whose attention_split_prep tiles always stage; tests/runtime/test_attn_prep_gpu.py
and test_attn_merge_gpu.py check those against this kind bit for bit).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.megakernel_backend import MegakernelBackend  # noqa: E402
from mpk_dist.taskgraph import lowering_attention  # noqa: E402
from mpk_dist.runtime.testing import (MAX_SEQ, SPLITS_ABOVE_AUTO, compare_logits, median, model, rand_ids,  # noqa: E402
                                      ref)
from mpk_dist.runtime.tables import MMA_MIN_BATCH, task_params  # noqa: E402
from mpk_dist.taskgraph.abi import TASK_COLS  # noqa: E402
from mpk_dist.taskgraph.fusion import FUSIONS  # noqa: E402
from mpk_dist.taskgraph.tasks import BY_NAME  # noqa: E402

# The reference's "fp32 accumulation" (as in test_megakernel_gpu.py): no reduced-precision split-K.
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

FORCED_STEPS = 256


def mk(name: str, schedule: str = "aot", attn_splits="auto", fuse=None) -> MegakernelBackend:
    """A mega-kernel backend with the fused linears only (``fuse``: another fusion list, True = the backend's
    default); a new one per call: the shared-memory sizing is read when it builds."""
    m = model(name)
    return MegakernelBackend(m.config, m.weights, tp=1, device="cuda", max_seq_len=MAX_SEQ, schedule=schedule,
                             attn_splits=attn_splits, fuse=sorted(FUSIONS) if fuse is None else fuse)


def forced_request(name: str, batch: int) -> GenerateRequest:
    vocab = model(name).config.vocab_size
    return GenerateRequest([rand_ids(4, vocab, 2)] * batch, FORCED_STEPS + 1, force_tokens=rand_ids(FORCED_STEPS, vocab, 3),
                           want_logits=True)


# The staged path's need, unpatched (the test compares the launch's shared memory with it).
_SPLIT_NEED = lowering_attention.attention_staging_bytes


def _per_warp(monkeypatch) -> None:
    """Withhold the staged path's shared memory (the runtime sizes it by default) so the per-warp
    path of attention_split.cuh runs."""
    orig = lowering_attention.attention_staging_bytes  # what tables.smem_bytes sizes the launch by
    monkeypatch.setattr(lowering_attention, "attention_staging_bytes",
                        lambda cg, kind, wt: 0 if kind == "attention_split" else orig(cg, kind, wt))


def test_auto_program_is_split(monkeypatch):
    """The backend compiled split attention (a silently unsplit run would prove nothing below); with its
    default fusions, as attention_split_prep tiles that merge in the last tile of each head."""
    cg = mk("qwen3-0.6b").session(1).cg
    kinds = [o["kind"] for o in cg.meta["ops"]]
    assert kinds.count("attention_split") == 28 and kinds.count("attention_merge") == 28 and "attention" not in kinds
    assert cg.meta["attn_splits"] == "auto"
    monkeypatch.delenv("MPK_FUSE_ATTN_PREP", raising=False)
    monkeypatch.delenv("MPK_FUSE_ATTN_MERGE", raising=False)
    kinds = [o["kind"] for o in mk("qwen3-0.6b", fuse=True).session(1).cg.meta["ops"]]
    assert kinds.count("attention_split_prep") == 28 and not {"attention_split", "attention_merge", "qkv_prep"} & set(kinds)
    # batch 8 with an explicit count ('auto' does not split above 4 sequences): one sequence per split tile
    cg8 = mk("qwen3-0.6b", fuse=True, attn_splits=2).session(8).cg
    rows = (cg8.arrays["tasks"][:, TASK_COLS["OPCODE"]] == BY_NAME["attention_split_prep"].opcode).nonzero()[0]
    assert len(rows) == 28 * 8 * 8 * 2 and {task_params(cg8, int(t))["BATCH"] for t in rows} == {1}

# The per-warp path runs only where the launch's shared memory can be withheld below the staged need:
# at tiny-llama b16 and qwen3-0.6b b4 the fused linears' staged input rows already need more (5376 >= 2304,
# 24832 >= 16640 bytes on the H200), so those run the staged path only. The per-warp batch-4 case runs scalar
# linear tiles: tensor-core tiles (the default from MMA_MIN_BATCH rows) size the launch for their split-K partials
# above the staged rows (tables.mma_partial_room), above the split tiles' staged need.
CASES = [("tiny", 1, "aot", False, "auto"), ("tiny", 1, "aot", True, "auto"), ("tiny", 4, "jit", False, SPLITS_ABOVE_AUTO),
         ("tiny", 4, "jit", True, SPLITS_ABOVE_AUTO), ("tiny-llama", 16, "aot", True, 3), ("qwen3-0.6b", 1, "aot", False, "auto"),
         ("qwen3-0.6b", 1, "aot", True, "auto"), ("qwen3-0.6b", 4, "jit", True, SPLITS_ABOVE_AUTO), ("tiny", 8, "jit", True, 4),
         ("qwen3-0.6b", 8, "aot", True, 2)]
"""Above 1 sequence 'auto' does not split (lowering_attention.AUTO_SPLIT_MAX_BATCH): those cases name a count.
Batch 4 takes the ranges 'auto' gave it before v0.28 (testing.SPLITS_ABOVE_AUTO; split tiles of all 4 sequences);
above 4 a split tile takes one sequence (lowering_attention.split_tiles)."""


@pytest.mark.parametrize("name,batch,schedule,staged,splits", CASES)
def test_split_teacher_forced_logits(name, batch, schedule, staged, splits, gpu_results, monkeypatch):
    """>= 256 teacher-forced steps: logits within 3% of their std at every step, argmax >= 99%."""
    if not staged:
        _per_warp(monkeypatch)
        if batch >= MMA_MIN_BATCH:  # the tensor-core tiles' partials would give the launch the staged need again
            monkeypatch.setenv("MPK_LINEAR_MMA", "0")
    req = forced_request(name, batch)
    b = mk(name, schedule, attn_splits=splits)
    got = b.generate(req)
    want = ref(name).generate(req)
    s = b.session(batch)
    smem = s.smem
    assert "attention_split" in {o["kind"] for o in s.cg.meta["ops"]}, "the program is not split"
    # the session's threads: the backend's worker_threads is None when the program chooses (tables.default_worker_threads)
    need = _SPLIT_NEED(s.cg, "attention_split", s.worker_threads)
    # the path under test really ran: the staged one had its shared memory, the per-warp one did not
    assert (smem >= need) if staged else (smem < need), (staged, smem, need)
    assert got.logits.shape == want.logits.shape, (got.logits.shape, want.logits.shape)
    err, agree = compare_logits(got.logits, want.logits)
    ok = err <= 0.03 and agree >= 0.99
    ms = sorted(got.per_token_ms)[len(got.per_token_ms) // 2] if got.per_token_ms else float("nan")
    gpu_results.append({"case": f"attn split {splits} {name} b{batch} {schedule} {'staged' if staged else 'per-warp'}",
                        "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "ms/token": f"{ms:.3f}", "smem": smem, "ok": ok})
    assert got.logits.shape[0] >= FORCED_STEPS
    assert err <= 0.03, f"max |err| / std = {err:.4f} > 0.03"
    assert agree >= 0.99, f"argmax agreement {agree:.4f} < 0.99"


def test_split_close_to_unsplit_kernel(gpu_results):
    """qwen3-0.6b b1: split (staged, as the runtime sizes it) and unsplit kernels differ only by
    attention's final rounding and what it propagates; recorded with ms/token of both."""
    req = forced_request("qwen3-0.6b", 1)
    split, plain = mk("qwen3-0.6b").generate(req), mk("qwen3-0.6b", attn_splits=1).generate(req)
    err, agree = compare_logits(split.logits, plain.logits)
    gpu_results.append({"case": "attn split vs unsplit qwen3-0.6b b1", "steps": split.logits.shape[0],
                        "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "ms/token": f"{median(split.per_token_ms):.3f}/{median(plain.per_token_ms):.3f}",
                        "ok": err <= 0.03 and agree >= 0.99})
    assert err <= 0.03 and agree >= 0.99, f"split vs unsplit kernel: max |err| / std {err:.4f}, argmax {agree:.4f}"
