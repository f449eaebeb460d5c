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


def test_layer_aligned_workers_put_each_op_on_the_same_workers_every_layer():
    """MPK_LAYER_ALIGNED_WORKERS: the cursor restarts at worker 0 at each layer's first op, so every layer's op i
    lands on the same workers (the default rotates them by tiles-a-layer mod workers); the per-worker lists hold
    every task once, in task order, and nothing but the placement changes."""
    from mpk_dist.taskgraph.serialize import layer_aligned_workers, round_robin_workers

    W = 5  # fewer workers than an op's tiles, so that the default placement rotates
    cg = programs(fp32("tiny"), 1, sms=W)[0]
    ops = cg.meta["ops"]
    out = layer_aligned_workers(cg)
    worker = out.arrays["tasks"][:, TASK_COLS["WORKER"]]
    starts = np.concatenate([[0], np.cumsum([o["tiles"] for o in ops])])
    by_layer: dict[str, list[list[int]]] = {}
    for i, o in enumerate(ops):
        if o["layer"] >= 0:
            kind = o["name"].split(".", 1)[-1]
            by_layer.setdefault(kind, []).append(worker[starts[i]:starts[i + 1]].tolist())
    layers = {len(v) for v in by_layer.values()}
    assert layers == {2}, by_layer  # tiny has 2 layers
    for kind, placements in by_layer.items():
        assert placements[0] == placements[1], (kind, placements)
    first = [i for i, o in enumerate(ops) if o["layer"] == 1][0]
    assert worker[starts[first]] == 0
    offs, lst = out.arrays["worker_offsets"], out.arrays["worker_tasks"]
    assert offs[-1] == len(worker) and sorted(lst.tolist()) == list(range(len(worker)))
    for w in range(W):
        mine = lst[offs[w]:offs[w + 1]]
        assert (worker[mine] == w).all() and (np.diff(mine) > 0).all()
    for name in ("events", "waits", "signals", "args", "params"):
        np.testing.assert_array_equal(out.arrays[name], cg.arrays[name])
    # the default placement is the same function without the restarts, and it does rotate here
    plain = round_robin_workers([(o["tiles"], o["layer"]) for o in ops], W)
    assert not np.array_equal(plain, worker)
    with pytest.raises(ValueError, match="one worker in"):
        from mpk_dist.taskgraph.serialize import with_workers

        with_workers(cg, np.full(len(worker), W))
