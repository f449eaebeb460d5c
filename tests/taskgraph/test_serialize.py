"""Save/load round trip of the serialized arrays; the ABI version is checked on load."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.abi import ARRAY_NAMES, TASK_COLS
from mpk_dist.taskgraph.serialize import load, save
from mpk_dist.taskgraph.testing import fp32, programs


def test_round_trip_and_version_check(tmp_path):
    cg = programs(fp32("tiny"), 2)[1]
    d = save(cg, tmp_path / "rank1")
    back = load(d)
    for name in ARRAY_NAMES:
        assert back.arrays[name].dtype == cg.arrays[name].dtype
        np.testing.assert_array_equal(back.arrays[name], cg.arrays[name])
    assert back.meta == cg.meta and back.meta["rank"] == 1
    np.testing.assert_array_equal(back.consts["rope_inv_freq"], cg.consts["rope_inv_freq"])
    meta = json.loads((d / "meta.json").read_text())
    meta["abi_version"] = -1
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(InputError, match="ABI version"):
        load(d)
    with pytest.raises(InputError, match="meta.json"):
        load(tmp_path / "nothing")


def test_tables_are_int32_and_ranges_contiguous():
    cg = programs(fp32("tiny"), 1)[0]
    t = cg.arrays["tasks"]
    assert t.dtype == np.int32 and cg.arrays["buffers"].dtype == np.int64
    for col in ("WAIT", "SIGNAL", "ARG", "PARAM"):
        begin, end = t[:, TASK_COLS[f"{col}_BEGIN"]], t[:, TASK_COLS[f"{col}_END"]]
        assert begin[0] == 0 and np.array_equal(begin[1:], end[:-1])
    off = cg.arrays["worker_offsets"]
    assert off[0] == 0 and off[-1] == cg.num_tasks and len(off) == cg.meta["workers"] + 1
