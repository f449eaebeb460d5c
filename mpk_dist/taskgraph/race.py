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

    def _unordered_writer(self, inst: int, hb: int, idx: np.ndarray, kind: str, label) -> Race | None:
        """A race ``kind`` if the last plain writer of some element of ``idx`` is not in ``hb``."""
        ws = self.writer[idx]
        for w in np.unique(ws):
            w = int(w)
            if w >= 0 and w != inst and not (hb >> w) & 1:
                return Race(kind, self.name, int(idx[np.nonzero(ws == w)[0][0]]), label(w), label(inst))
        return None

    def _unordered_entry(self, entries, inst: int, hb: int, idx: np.ndarray, kind: str, label) -> Race | None:
        """A race ``kind`` if an access of ``entries`` (reads or accumulations) touching ``idx`` is not in ``hb``."""
        if not entries:
            return None
        hit = np.zeros(len(self.writer), bool)
        hit[idx] = True
        for e, eidx in entries:
            touched = hit[eidx]
            if e != inst and touched.any() and not (hb >> e) & 1:
                return Race(kind, self.name, int(eidx[np.nonzero(touched)[0][0]]), label(e), label(inst))
        return None

    def check_accumulate(self, inst: int, hb: int, idx: np.ndarray, label) -> Race | None:
        """Record an accumulating write: a race if the last plain writer or a read since is unordered."""
        if len(idx) == 0:
            return None
        race = (self._unordered_writer(inst, hb, idx, "accumulate-after-write", label)
                or self._unordered_entry(self.reads, inst, hb, idx, "accumulate-after-read", label))
        if race is None:
            self.accs.append((inst, idx))
        return race

    def check_read(self, inst: int, hb: int, idx: np.ndarray, label) -> Race | None:
        """Record a read by instance ``inst`` (happens-before set ``hb``); a race if a writer is unordered."""
        if len(idx) == 0:
            return None
        race = (self._unordered_writer(inst, hb, idx, "read-after-write", label)
                or self._unordered_entry(self.accs, inst, hb, idx, "read-after-accumulate", label))
        if race is None:
            self.reads.append((inst, idx))
        return race

    def check_write(self, inst: int, hb: int, idx: np.ndarray, label) -> Race | None:
        """Record a write; a race if an earlier writer, accumulation or reader of these elements is unordered."""
        if len(idx) == 0:
            return None
        race = (self._unordered_writer(inst, hb, idx, "write-after-write", label)
                or self._unordered_entry(self.accs, inst, hb, idx, "write-after-accumulate", label)
                or self._unordered_entry(self.reads, inst, hb, idx, "write-after-read", label))
        if race is not None:
            return race
        hit = np.zeros(len(self.writer), bool)
        hit[idx] = True
        # accesses wholly overwritten need no later check; partly overwritten ones keep all their elements
        self.accs = [(a, aidx) for a, aidx in self.accs if not hit[aidx].all()]
        self.reads = [(r, ridx) for r, ridx in self.reads if not hit[ridx].all()]
        self.writer[idx] = inst
        return None
