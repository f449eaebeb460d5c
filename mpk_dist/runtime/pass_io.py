"""The host side of persistent passes (csrc/runtime/pass_begin.cuh; docs/SERVING.md "Persistent passes").

One ``PassChannel`` per rank session: a mapped pinned stage holding one pass's inputs, a mapped
pinned doorbell ([posted passes, stop]) and the copy table that tells step_begin where each staged
input goes (buffer, words, destination words per step: ``forced_tokens`` takes row s). The host posts
pass s by writing the stage, then the doorbell; it may write the stage again only after step s's final
task (the kernel copied it at step_begin, an ancestor of that task).
"""

from __future__ import annotations

import platform

import numpy as np
import torch

from mpk_dist.errors import InputError
from mpk_dist.runtime.params import DOORBELL_POSTED, DOORBELL_STOP, PASS_COPY_COLS


def check_host_order() -> None:
    """The doorbell store must become visible after the stage stores; Python cannot fence, so only a
    total-store-order host (x86-64) qualifies."""
    arch = platform.machine().lower()
    if arch not in ("x86_64", "amd64"):
        raise InputError(f"persistent passes: expected an x86-64 host (its store order publishes the pass before "
                         f"the doorbell), got {arch}; use persistent_passes=0 (a launch per pass)")


class PassChannel:
    """Stage, doorbell and copy table of one rank session; ``inputs``: (buffer name, words per step
    of the destination: 0, or the row length for a per-step row such as forced_tokens)."""

    def __init__(self, session, inputs: list[tuple[str, int]], wait_s: float):
        from mpk_dist.runtime.session import _pinned

        if wait_s <= 0:
            raise InputError(f"pass_wait_s: expected a positive number of seconds, got {wait_s}")
        names = [b["name"] for b in session.cg.meta["buffers"]]
        rows, self.layout, off = [], {}, 0
        for name, per_step in inputs:
            if name not in names:
                raise InputError(f"persistent passes: expected an input buffer named {name!r} in the program")
            b = names.index(name)
            t = session.bufs[b]
            if t.dtype != torch.int32:
                raise InputError(f"persistent passes: expected {name} to be int32, got {t.dtype}")
            words = per_step or t.numel()
            rows.append((off, b, words, per_step))
            self.layout[name] = (off, words)
            off += words
        self.stage = _pinned(off, torch.int32)
        self.doorbell = _pinned(2, torch.int32)
        table = np.array(rows, dtype=np.int32).reshape(-1, PASS_COPY_COLS)
        self.copies = torch.from_numpy(table).to(session.device)
        self.wait_s = float(wait_s)
        self._addr = session._addr

    def reset(self) -> None:
        """Before a launch: nothing posted, no stop."""
        self.doorbell.zero_()

    def fill(self, p) -> None:
        """The RuntimeParams fields of the channel."""
        p.pass_doorbell, p.pass_stage = self._addr(self.doorbell), self._addr(self.stage)
        p.pass_copies, p.num_pass_copies = self.copies.data_ptr(), int(self.copies.shape[0])
        p.pass_wait_ns = int(self.wait_s * 1e9)

    def post(self, s: int, arrays: dict[str, np.ndarray]) -> None:
        """Stage pass ``s``'s inputs (every name of the layout), then ring the doorbell."""
        stage = self.stage.numpy()
        for name, (off, words) in self.layout.items():
            a = np.asarray(arrays[name], dtype=np.int32).reshape(-1)
            if a.size != words:
                raise InputError(f"pass {s}: expected {words} words of {name}, got {a.size}")
            stage[off: off + words] = a
        self.doorbell.numpy()[DOORBELL_POSTED] = s + 1  # after the stage (x86-64 store order)

    def stop(self) -> None:
        """Ask the running launch to end at its next step_begin."""
        self.doorbell.numpy()[DOORBELL_STOP] = 1

    @property
    def posted(self) -> int:
        """Passes posted in this launch."""
        return int(self.doorbell[DOORBELL_POSTED])
