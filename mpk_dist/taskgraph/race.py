"""Race detection for the interpreter: happens-before as bitsets, shadow state per buffer element.

Each executed task instance (rank, task, step) gets an id; its happens-before set is a Python int
with one bit per earlier instance. An event counter carries the union of the sets of the instances
that signalled it (plus their own bits), and a wait that is satisfied at count c takes the union as
it stood at c: exactly the release/acquire semantics of a counter incremented with release RMWs.
Program order on a worker is NOT counted, so a race is reported even if the schedule happened to
run the two tasks in a safe order.

Shadow state per (rank, buffer): the last writer of every element and the reads since. A read of an
element whose last writer is not in the reader's set, a write over an element whose last writer or
any reader since is not in the writer's set, is a race; the report names both task instances.
Host-written buffers (weights, constants, inputs) are not tracked: the host writes them before the
launch.

Accumulating writes (mode 'a': atomic adds that commute, e.g. the down partials of fusion 'silu_down') need
not be ordered among themselves, but each must be ordered after the element's last plain writer and its
reads since, and a later read or plain write must be ordered after every accumulation since that writer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Race:
    """One detected race: ``kind`` is read-after-write, write-after-read or write-after-write."""

    kind: str
    buffer: str
    element: int
    first: str   # the earlier access (its task instance label)
    second: str  # the access that is not ordered after it

    def __str__(self) -> str:
        return (f"race ({self.kind}) on {self.buffer}[{self.element}]: {self.second} is not ordered "
                f"after {self.first} by any event")


class RaceError(RuntimeError):
    """Raised by the interpreter (on_race='raise') at the first race; carries the ``Race``."""

    def __init__(self, race: Race):
        super().__init__(str(race))
        self.race = race


class Shadow:
    """Last writer per element and reads since, for one buffer on one rank."""

    def __init__(self, name: str, numel: int):
        self.name = name
        self.writer = np.full(numel, -1, np.int64)
        self.reads: list[tuple[int, np.ndarray]] = []
        self.accs: list[tuple[int, np.ndarray]] = []  # accumulations since each element's last plain write

    def _unordered_acc(self, inst: int, hb: int, idx: np.ndarray, kind: str, label) -> Race | None:
        hit = np.zeros(len(self.writer), bool)
        hit[idx] = True
        for a, aidx in self.accs:
            touched = hit[aidx]
            if a != inst and touched.any() and not (hb >> a) & 1:
                return Race(kind, self.name, int(aidx[np.nonzero(touched)[0][0]]), label(a), label(inst))
        return None

    def check_accumulate(self, inst: int, hb: int, idx: np.ndarray, label) -> Race | None:
        """Record an accumulating write: a race if the last plain writer or a read since is unordered."""
        if len(idx) == 0:
            return None
        ws = self.writer[idx]
        for w in np.unique(ws):
            w = int(w)
            if w >= 0 and w != inst and not (hb >> w) & 1:
                el = int(idx[np.nonzero(ws == w)[0][0]])
                return Race("accumulate-after-write", self.name, el, label(w), label(inst))
        hit = np.zeros(len(self.writer), bool)
        hit[idx] = True
        for r, ridx in self.reads:
            touched = hit[ridx]
            if r != inst and touched.any() and not (hb >> r) & 1:
                el = int(ridx[np.nonzero(touched)[0][0]])
                return Race("accumulate-after-read", self.name, el, label(r), label(inst))
        self.accs.append((inst, idx))
        return None

    def check_read(self, inst: int, hb: int, idx: np.ndarray, label) -> Race | None:
        """Record a read by instance ``inst`` (happens-before set ``hb``); a race if a writer is unordered."""
        if len(idx) == 0:
            return None
        ws = self.writer[idx]
        for w in np.unique(ws):
            w = int(w)
            if w >= 0 and w != inst and not (hb >> w) & 1:
                el = int(idx[np.nonzero(ws == w)[0][0]])
                return Race("read-after-write", self.name, el, label(w), label(inst))
        if self.accs:
            race = self._unordered_acc(inst, hb, idx, "read-after-accumulate", label)
            if race is not None:
                return race
        self.reads.append((inst, idx))
        return None

    def check_write(self, inst: int, hb: int, idx: np.ndarray, label) -> Race | None:
        """Record a write; a race if an earlier writer or reader of these elements is unordered."""
        if len(idx) == 0:
            return None
        ws = self.writer[idx]
        for w in np.unique(ws):
            w = int(w)
            if w >= 0 and w != inst and not (hb >> w) & 1:
                el = int(idx[np.nonzero(ws == w)[0][0]])
                return Race("write-after-write", self.name, el, label(w), label(inst))
        if self.accs:
            race = self._unordered_acc(inst, hb, idx, "write-after-accumulate", label)
            if race is not None:
                return race
        hit = np.zeros(len(self.writer), bool)
        hit[idx] = True
        self.accs = [(a, aidx) for a, aidx in self.accs if not hit[aidx].all()]
        kept = []
        for r, ridx in self.reads:
            touched = hit[ridx]
            if r != inst and touched.any() and not (hb >> r) & 1:
                el = int(ridx[np.nonzero(touched)[0][0]])
                return Race("write-after-read", self.name, el, label(r), label(inst))
            if not touched.all():
                kept.append((r, ridx))
        self.reads = kept
        self.writer[idx] = inst
        return None
