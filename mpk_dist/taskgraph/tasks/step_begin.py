"""step_begin: the first task of every decode step; picks the step's input token and position.

One task per step. tokens[b] = forced[step, b] if that is >= 0 (prompt / teacher forcing), else
next_token[b] (the token argmax_select produced in the previous step); positions[b] =
start_pos[b] + step. Its wait on argmax_select with step offset -1 is the step-to-step edge.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext


class StepBegin(TaskKind):
    """Write tokens[B] and positions[B] of the current step."""

    name = "step_begin"
    opcode = 0
    doc = "tokens[b] = forced[step,b] >= 0 ? forced[step,b] : next_token[b]; positions[b] = start_pos[b] + step"
    args = (
        ArgSpec("FORCED", "r", "i32 [MAX_STEPS, B] host-written ids; -1 = use next_token"),
        ArgSpec("START_POS", "r", "i32 [B] position of step 0"),
        ArgSpec("NEXT_TOKEN", "r", "i32 [B] token chosen by the previous step's argmax_select"),
        ArgSpec("TOKENS", "w", "i32 [B] this step's input ids"),
        ArgSpec("POSITIONS", "w", "i32 [B] this step's positions"),
    )
    params = (
        ParamSpec("BATCH", "B, sequences"),
        ParamSpec("MAX_STEPS", "rows of FORCED: steps one launch may run"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, s = t.p("BATCH"), t.step
        if s >= t.p("MAX_STEPS"):
            raise InputError(f"step: expected < {t.p('MAX_STEPS')} steps per launch, got step {s}")
        forced = t.buf("FORCED")[t.off("FORCED") + s * B: t.off("FORCED") + (s + 1) * B]
        nxt = t.buf("NEXT_TOKEN")[t.off("NEXT_TOKEN"): t.off("NEXT_TOKEN") + B]
        tok = t.buf("TOKENS")[t.off("TOKENS"): t.off("TOKENS") + B]
        tok.copy_(forced.where(forced >= 0, nxt))
        start = t.buf("START_POS")[t.off("START_POS"): t.off("START_POS") + B]
        t.buf("POSITIONS")[t.off("POSITIONS"): t.off("POSITIONS") + B].copy_(start + s)

    def accesses(self, t: TileContext) -> list[Access]:
        B = t.p("BATCH")
        ar = np.arange(B)
        return [Access(0, "r", t.off("FORCED") + t.step * B + ar), Access(1, "r", t.off("START_POS") + ar),
                Access(2, "r", t.off("NEXT_TOKEN") + ar), Access(3, "w", t.off("TOKENS") + ar),
                Access(4, "w", t.off("POSITIONS") + ar)]


KIND = StepBegin()
