"""Shadow state: which unordered accesses are races (happens-before sets are bitsets of instance ids)."""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.race import Shadow

LABEL = "task{}".format


def test_read_after_unordered_write_is_a_race_and_ordered_is_not():
    sh = Shadow("buf", 8)
    assert sh.check_write(0, 0, np.arange(4), LABEL) is None
    assert sh.check_read(1, 1 << 0, np.arange(2), LABEL) is None      # reader knows writer 0
    race = sh.check_read(2, 0, np.array([3]), LABEL)                   # reader 2 does not
    assert race.kind == "read-after-write" and race.first == "task0" and race.second == "task2" and race.element == 3
    assert sh.check_read(3, 0, np.array([6, 7]), LABEL) is None        # never written: host data


def test_write_after_read_and_write_after_write():
    sh = Shadow("buf", 8)
    sh.check_write(0, 0, np.arange(8), LABEL)
    sh.check_read(1, 1, np.arange(4), LABEL)
    race = sh.check_write(2, 1 << 0, np.array([2]), LABEL)              # ordered after writer, not reader 1
    assert race.kind == "write-after-read" and race.first == "task1"
    assert sh.check_write(3, (1 << 0) | (1 << 1), np.arange(4), LABEL) is None
    race = sh.check_write(4, 1 << 0, np.array([0]), LABEL)              # misses writer 3
    assert race.kind == "write-after-write" and race.first == "task3"
    assert "not ordered after task3" in str(race)


def test_accumulations_commute_but_are_ordered_against_plain_accesses():
    """Mode 'a' (atomic adds, fusion 'silu_down'): two unordered accumulations are no race; each must follow the
    last plain writer; a later read or plain write must follow every accumulation since that writer."""
    sh = Shadow("buf", 8)
    sh.check_write(0, 0, np.arange(8), LABEL)
    race = sh.check_accumulate(1, 0, np.arange(8), LABEL)               # does not know writer 0
    assert race.kind == "accumulate-after-write" and race.first == "task0"
    sh = Shadow("buf", 8)
    sh.check_write(0, 0, np.arange(8), LABEL)
    assert sh.check_accumulate(1, 1 << 0, np.arange(8), LABEL) is None
    assert sh.check_accumulate(2, 1 << 0, np.arange(8), LABEL) is None  # unordered with 1: commuting adds
    race = sh.check_read(3, (1 << 0) | (1 << 1), np.array([5]), LABEL)  # misses accumulation 2
    assert race.kind == "read-after-accumulate" and race.first == "task2"
    assert sh.check_read(4, 0b111, np.arange(8), LABEL) is None
    race = sh.check_write(5, 0b10011, np.array([1]), LABEL)               # misses accumulation 2
    assert race.kind == "write-after-accumulate" and race.first == "task2"
    assert sh.check_write(6, 0b11111, np.arange(8), LABEL) is None      # after all: the accumulations are cleared
    assert sh.check_read(7, 1 << 6, np.arange(8), LABEL) is None
