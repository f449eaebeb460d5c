"""Helpers shared by the mega-kernel's GPU tests (tests/runtime/*_gpu.py): the acceptance metric
against the torch reference, seeded token ids, a median. Kept in the package because the tests
run with --import-mode=importlib and cannot import each other."""

from __future__ import annotations

import torch


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` reproducible token ids below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# The GPU tests' acceptance: max|a-b| / std(ref) <= ERR_TOL and argmax agreement >= AGREE_MIN.
ERR_TOL = 0.03
AGREE_MIN = 0.99


def compare_logits(a: torch.Tensor, b: torch.Tensor, tie_tol: float = ERR_TOL) -> tuple[float, float]:
    """(worst over steps of max|a-b| / std(b), share of (step, seq) whose argmax agrees); b is the reference.

    A different argmax still agrees when it is a near-tie of the reference: the reference rates
    ``a``'s pick at most ``2 * tie_tol * std(b)`` below its own top logit, a gap that two results
    each within the accepted error of the truth can flip (random-weight models have such ties).
    Any other difference counts against. The acceptance is err <= ERR_TOL and agreement >= AGREE_MIN.
    """
    a, b = a.float(), b.float()
    std = b.flatten(1).std(dim=1)
    err = (a - b).abs().flatten(1).max(dim=1).values / std
    pick_a, pick_b = a.argmax(-1), b.argmax(-1)
    gap = (b.gather(-1, pick_b.unsqueeze(-1)) - b.gather(-1, pick_a.unsqueeze(-1))).squeeze(-1)
    tol = (2 * tie_tol * std).view(-1, *([1] * (gap.dim() - 1)))
    agree = (pick_a == pick_b) | (gap <= tol)
    return float(err.max()), float(agree.float().mean())


def median(xs) -> float:
    """Median (upper middle) of a list, NaN when empty."""
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


# KV-cache length of every GPU test model: >= 256 teacher-forced steps plus a short prompt.
MAX_SEQ = 320
# Shared by all GPU test modules of one pytest process, so a preset's weights are made once.
_MODELS: dict = {}
_REFS: dict = {}


def model(name: str):
    """Random-weight preset on the GPU (small ones are HF checkpoints written to $MPK_CACHE_DIR); cached."""
    assert torch.cuda.is_available(), "gpu tests need a CUDA GPU (run them with scripts/gpu_check.sh on the device)"
    from mpk_dist.model_source import open_model

    if name not in _MODELS:
        _MODELS[name] = open_model(name, seed=0, device="cuda")
    return _MODELS[name]


def ref(name: str, tp: int = 1):
    """The torch eager reference at ``tp`` (all ranks in this process, MAX_SEQ cache); cached."""
    from mpk_dist.backends.torch_backend import TorchBackend

    if (name, tp) not in _REFS:
        m = model(name)
        _REFS[name, tp] = TorchBackend(m.config, m.weights, tp=tp, device="cuda", max_seq_len=MAX_SEQ, mode="eager")
    return _REFS[name, tp]


def written_buffers(cg) -> set[str]:
    """Names of the buffers some task of compiled program ``cg`` writes: a buffer only declared (q under
    attn_prep in a split program, kept in the tiles' shared memory) holds nothing to compare."""
    from mpk_dist.taskgraph.abi import ARG_COLS, TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_OPCODE

    tasks, args, names = cg.arrays["tasks"], cg.arrays["args"], [x["name"] for x in cg.meta["buffers"]]
    out = set()
    for row in tasks:
        spec = BY_OPCODE[int(row[TASK_COLS["OPCODE"]])].args
        for i, k in enumerate(range(int(row[TASK_COLS["ARG_BEGIN"]]), int(row[TASK_COLS["ARG_END"]]))):
            b = int(args[k, ARG_COLS["BUFFER"]])
            if b >= 0 and "w" in spec[i].mode:
                out.add(names[b])
    return out
