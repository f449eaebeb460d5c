"""One rank of a ``--transport ipc`` mega-kernel group, started by tests/runtime/test_megakernel_ipc_gpu.py
through launch/mpirun.sh (which starts a private MPS daemon when ranks share a GPU).

    python tests/runtime/ipc_job.py MODE OUT_DIR [--repeats N] [--greedy-0p6b]

MODE:
  check      teacher-forced logits of tiny and tiny-llama (257 steps; rank 0 saves them with the
             request to OUT_DIR/<model>_np<W>.pt), N back-to-back greedy runs compared bitwise,
             optionally 64 greedy tokens of qwen3-0.6b (OUT_DIR/qwen3-0.6b_np<W>.pt)
  stall      rank 1's kernel runs a layer-0 task that never signals (watchdog 1 s)
  hoststall  rank 1's host never reaches the launch (sleeps); the others' pre-launch wait is bounded
  die        rank 1 exits before the launch
Every rank prints one JSON line {"rank": r, ...}; a rank that catches an MpkError prints it under
"error" and exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from mpk_dist.backends.base import GenerateRequest
from mpk_dist.dist.env import rank_info
from mpk_dist.errors import MpkError
from mpk_dist.model_source import open_model
from mpk_dist.runtime.megakernel_backend import MegakernelBackend

MAX_SEQ = 320
FORCED_STEPS = 256


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def backend(name: str, world: int, **kw) -> tuple[MegakernelBackend, int]:
    m = open_model(name, seed=0, device="cuda")
    b = MegakernelBackend(m.config, m.weights, tp=world, device="cuda", max_seq_len=MAX_SEQ, transport="ipc", **kw)
    return b, m.config.vocab_size


def check(out: dict, args, rank: int, world: int) -> None:
    """Forced logits per model, repeat runs bitwise, optional qwen3-0.6b greedy tokens."""
    for name in ("tiny", "tiny-llama"):
        b, vocab = backend(name, world)
        req = GenerateRequest([rand_ids(4, vocab, 2)], FORCED_STEPS + 1, force_tokens=rand_ids(FORCED_STEPS, vocab, 3),
                              want_logits=True)
        res = b.generate(req)
        if rank == 0:
            torch.save({"prompt": req.prompts[0], "force": req.force_tokens, "logits": res.logits,
                        "per_token_ms": res.per_token_ms}, os.path.join(args.out, f"{name}_np{world}.pt"))
        if name == "tiny":
            rep = GenerateRequest([rand_ids(6, vocab, 4)], 32, want_logits=True)
            first = b.generate(rep)
            bad = 0
            for _ in range(args.repeats - 1):
                r = b.generate(rep)
                bad += int(r.tokens != first.tokens or (rank == 0 and not torch.equal(r.logits, first.logits)))
            out["repeat_mismatches"], out["repeats"] = bad, args.repeats
            out["exposed_comm_share"] = first.extra.get("exposed_comm_share")
    if args.greedy_0p6b:
        b, vocab = backend("qwen3-0.6b", world)
        res = b.generate(GenerateRequest([rand_ids(8, vocab, 10)], 64))
        if rank == 0:
            torch.save({"prompt": rand_ids(8, vocab, 10), "tokens": res.tokens, "per_token_ms": res.per_token_ms},
                       os.path.join(args.out, f"qwen3-0.6b_np{world}.pt"))


def stall(out: dict, rank: int, world: int, host: bool) -> None:
    """Rank 1 stalls: in its kernel (a task that never signals) or on the host (never launches)."""
    b, _ = backend("tiny", world, timeout_s=1.0)
    cg = b.session(1).cg
    victim = next(t for t in range(cg.num_tasks) if "L0.qkv_proj" in cg.task_label(t))
    out["victim"] = cg.task_label(victim)
    if host and rank == 1:
        time.sleep(600)
    if not host:
        b.inject_hang_task, b.inject_hang_rank = victim, 1
    b.generate(GenerateRequest([[1, 2, 3]], 8))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["check", "stall", "hoststall", "die"])
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--greedy-0p6b", action="store_true")
    args = p.parse_args()
    info = rank_info()
    rank, world = info.rank, info.world_size
    out: dict = {"rank": rank, "world": world, "mode": args.mode}
    t0 = time.perf_counter()
    try:
        if args.mode == "check":
            check(out, args, rank, world)
        elif args.mode == "die":
            b, _ = backend("tiny", world, timeout_s=1.0)
            b.session(1)
            if rank == 1:
                os._exit(7)
            b.generate(GenerateRequest([[1, 2, 3]], 8))
        else:
            stall(out, rank, world, host=args.mode == "hoststall")
    except MpkError as exc:
        out["error"], out["seconds"] = f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
        print(json.dumps(out), flush=True)
        return 3
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
