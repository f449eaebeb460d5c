"""argmax_select: pick the step's token from the gathered candidates; write it for the next step
and into the launch's token output (row ``step``)."""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.argmax_partial import best_pair
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext


class ArgmaxSelect(TaskKind):
    """token[b] = index of the best candidate over ranks; NEXT_TOKEN[b] and TOKEN_OUT[step, b] = token[b]."""

    name = "argmax_select"
    opcode = 13
    doc = "tok[b] = best over ranks of cands[r, b] (ties to the lowest index); next_token[b] = token_out[step, b] = tok[b]"
    args = (
        ArgSpec("CANDS", "r", "symmetric f32 [WORLD, B, 2]"),
        ArgSpec("NEXT_TOKEN", "w", "i32 [B] read by the next step's step_begin"),
        ArgSpec("TOKEN_OUT", "w", "i32 [MAX_STEPS, B] tokens of the launch, streamed to the host"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("WORLD", "ranks"),
        ParamSpec("MAX_STEPS", "rows of TOKEN_OUT"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, W, s = t.p("BATCH"), t.p("WORLD"), t.step
        if s >= t.p("MAX_STEPS"):
            raise InputError(f"step: expected < {t.p('MAX_STEPS')} steps per launch, got step {s}")
        c = t.buf("CANDS")[t.off("CANDS"): t.off("CANDS") + W * B * 2].view(W, B, 2).permute(1, 0, 2)  # [B, W, 2]
        _, idx = best_pair(c[..., 0], c[..., 1])
        tok = idx.to(t.buf("NEXT_TOKEN").dtype)
        t.buf("NEXT_TOKEN")[t.off("NEXT_TOKEN"): t.off("NEXT_TOKEN") + B].copy_(tok)
        o = t.off("TOKEN_OUT") + s * B
        t.buf("TOKEN_OUT")[o: o + B].copy_(tok)

    def accesses(self, t: TileContext) -> list[Access]:
        B, W = t.p("BATCH"), t.p("WORLD")
        ar = np.arange(B)
        return [Access(0, "r", t.off("CANDS") + np.arange(W * B * 2)), Access(1, "w", t.off("NEXT_TOKEN") + ar),
                Access(2, "w", t.off("TOKEN_OUT") + t.step * B + ar)]


KIND = ArgmaxSelect()
