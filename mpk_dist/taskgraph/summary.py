"""Human views of a compiled program: a JSON summary (counts per op kind and layer, bytes per task)
and a Graphviz picture of one layer (tasks grouped by op, events as small nodes)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from mpk_dist.taskgraph.abi import DTYPE_BYTES, NULL_BUFFER, TASK_COLS
from mpk_dist.taskgraph.serialize import CompiledGraph
from mpk_dist.taskgraph.tasks import BY_OPCODE


def task_traffic(cg: CompiledGraph) -> np.ndarray:
    """[T, 2] int64: bytes each task reads and writes in device memory (remote writes x WORLD)."""
    t, a, p = cg.arrays["tasks"], cg.arrays["args"], cg.arrays["params"]
    dt = [DTYPE_BYTES[b["dtype"]] for b in cg.meta["buffers"]]
    world = int(cg.meta["world_size"])
    out = np.zeros((len(t), 2), np.int64)
    for i, row in enumerate(t):
        kind = BY_OPCODE[int(row[TASK_COLS["OPCODE"]])]
        rows = a[row[TASK_COLS["ARG_BEGIN"]]: row[TASK_COLS["ARG_END"]]]
        counts = [0 if r[0] == NULL_BUFFER else int(r[2]) for r in rows]
        eb = [0 if r[0] == NULL_BUFFER else dt[int(r[0])] for r in rows]
        out[i] = kind.traffic(counts, eb, p[row[TASK_COLS["PARAM_BEGIN"]]: row[TASK_COLS["PARAM_END"]]].tolist(), world)
    return out


def summarize(cg: CompiledGraph, timings: dict | None = None) -> dict:
    """Counts per op kind and per layer, per-task bytes, totals (JSON-able)."""
    t = cg.arrays["tasks"]
    traffic = task_traffic(cg)
    kinds = [BY_OPCODE[int(x)].name for x in t[:, TASK_COLS["OPCODE"]]]
    ev_op = cg.arrays["events"][:, 2]
    ops = cg.meta["ops"]
    per_kind: dict[str, dict] = {}
    for i, k in enumerate(kinds):
        d = per_kind.setdefault(k, {"tasks": 0, "events": 0, "read_bytes": 0, "write_bytes": 0})
        d["tasks"] += 1
        d["read_bytes"] += int(traffic[i, 0])
        d["write_bytes"] += int(traffic[i, 1])
    for e in ev_op:
        per_kind[ops[int(e)]["kind"]]["events"] += 1
    layers = t[:, TASK_COLS["LAYER"]]
    ev_layers = Counter(ops[int(e)]["layer"] for e in ev_op)
    per_layer = {str(int(L)): {"tasks": int((layers == L).sum()), "events": int(ev_layers.get(int(L), 0))}
                 for L in sorted(set(layers.tolist()))}
    return {
        "model": cg.meta.get("model"), "rank": cg.meta["rank"], "world_size": cg.meta["world_size"],
        "batch": cg.meta["batch"], "sms": cg.meta["workers"], "abi_version": cg.meta["abi_version"],
        "tasks": cg.num_tasks, "events": cg.num_events, "waits": int(len(cg.arrays["waits"])),
        "signals": int(len(cg.arrays["signals"])), "buffers": int(len(cg.arrays["buffers"])),
        "read_bytes": int(traffic[:, 0].sum()), "write_bytes": int(traffic[:, 1].sum()),
        "per_kind": per_kind, "per_layer": per_layer,
        "ops": [{"name": o["name"], "kind": o["kind"], "layer": o["layer"], "tiles": o["tiles"]} for o in ops],
        "task_bytes": {"columns": ["op_index", "tile", "read_bytes", "write_bytes"],
                       "rows": np.column_stack([t[:, TASK_COLS["OP_INDEX"]], t[:, TASK_COLS["TILE"]], traffic]).tolist()},
        **({"compile_seconds": timings} if timings else {}),
    }


def layer_dot(cg: CompiledGraph, layer: int) -> str:
    """Graphviz text of one layer: a cluster per op (one box per tile), events as points."""
    t, w, s = cg.arrays["tasks"], cg.arrays["waits"], cg.arrays["signals"]
    ids = np.nonzero(t[:, TASK_COLS["LAYER"]] == layer)[0]
    lines = [f'digraph "layer {layer}" {{', "  rankdir=TB; node [shape=box, fontsize=9];"]
    by_op: dict[int, list[int]] = {}
    for i in ids:
        by_op.setdefault(int(t[i, TASK_COLS["OP_INDEX"]]), []).append(int(i))
    for o, tasks in by_op.items():
        op = cg.meta["ops"][o]
        lines.append(f'  subgraph "cluster_{o}" {{ label="{op["name"]} ({op["kind"]})";')
        lines += [f'    t{i} [label="{int(t[i, TASK_COLS["TILE"]])}"];' for i in tasks]
        lines.append("  }")
    events = set()
    for i in ids:
        for k in range(t[i, TASK_COLS["SIGNAL_BEGIN"]], t[i, TASK_COLS["SIGNAL_END"]]):
            e = int(s[k, 0])
            events.add(e)
            lines.append(f"  t{i} -> e{e}" + (' [color=red]' if s[k, 1] < -1 else "") + ";")
        for k in range(t[i, TASK_COLS["WAIT_BEGIN"]], t[i, TASK_COLS["WAIT_END"]]):
            e = int(w[k, 0])
            events.add(e)
            lines.append(f"  e{e} -> t{i}" + (' [style=dashed]' if w[k, 1] else "") + ";")
    for e in sorted(events):
        lines.append(f'  e{e} [shape=point, xlabel="{cg.meta["events"][e]}", fontsize=7];')
    lines.append("}")
    return "\n".join(lines) + "\n"
