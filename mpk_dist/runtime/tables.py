"""Derived tables the runtime needs beyond the ABI arrays, and checks of what the kernel supports.

* jit dependents: for each event, the tasks that wait on it with the wait's step offset (CSR).
* the final task (argmax_select), whose block runs the step epilogue.
* limits of the CUDA task bodies (batch, head dim, group size, alignment) checked up front, so an
  unsupported shape is a clear error here rather than a wrong result on the GPU.
* the kernel's batch (``kernel_batch``): the rows of every linear-kind tile, MPK_BATCH.
* dynamic shared memory the worker blocks need.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.abi import TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.tasks import BY_NAME

from mpk_dist.taskgraph.lowering import ROW_BLOCK

MAX_BATCH = 256
"""Sequences (or tokens of a paged pass) per program: linear-kind ops over more than ROW_BLOCK rows
are tiled in row blocks of ROW_BLOCK (docs/TASKGRAPH.md, "Row blocks"), so above ROW_BLOCK the batch
must be a multiple of it (the hosts pad: ``padded_batch``). The other bodies loop over any batch."""
LINEAR_KINDS = ("linear", "norm_linear", "linear_residual", "silu_linear", "norm_linear_silu")
"""Kinds whose CUDA body runs MPK_BATCH rows (a compile-time constant of the generated kernel;
csrc/tasks/linear.cuh, fused_gemv.cuh, linear_mma.cuh, weight_stream.cuh) whatever the task's BATCH says."""
MAX_GROUP = 8
MAX_ATTN_HEAD_DIM = 256
MAX_WORLD = 8


def kernel_batch(cg) -> int:
    """MPK_BATCH of the kernel that runs ``cg``: the rows of each linear-kind tile, min(batch, ROW_BLOCK)."""
    return min(int(cg.meta["batch"]), ROW_BLOCK)


UNROLLS_BATCH1 = (16, 8, 4)
"""16-byte weight loads in flight per lane a batch-1 program may get, widest first."""
UNROLL_MIN_ROUNDS = 2
"""A batch-1 program gets the widest unroll u for which its smallest linear tile holds at least this many rounds
(a round: worker threads x u loads x 16 B), else the narrowest. Measured on an H200 at context ~512 (docs/PERF.md
v0.14, one process per model, the same tokens): qwen3-8b 4.94 vs 5.01 ms and llama3-8b 4.71 vs 4.76 with 16
(smallest tile o_proj, 256 KB: two rounds of 16); qwen3-1.7b 1.754 vs 1.785 with 4 (64 KB tiles) and 1.91 with 16;
qwen3-0.6b 1.177 vs 1.256 with 4 (32 KB tiles) and 1.46 with 16: loads past a short tile's end are wasted slots."""
WEIGHT_BYTES = 2
"""Bytes per weight the linear bodies read (bf16)."""
LOAD_BYTES = 16
"""Bytes of one weight load of a lane (the unroll counts these)."""


def _linear_tile_bytes(cg) -> list[int]:
    """Weight bytes of one tile of each linear op of ``cg``."""
    tasks = cg.arrays["tasks"]
    _, first = np.unique(tasks[:, TASK_COLS["OP_INDEX"]], return_index=True)  # one tile per op
    linear = [BY_NAME[k].opcode for k in LINEAR_KINDS]
    return [weight_block_bytes(cg, int(t)) for t in first if int(tasks[t, TASK_COLS["OPCODE"]]) in linear]


def default_linear_unroll(cg, worker_threads: int) -> int:
    """MPK_LINEAR_UNROLL for program ``cg``: at batch 1 the widest of UNROLLS_BATCH1 whose rounds fit
    UNROLL_MIN_ROUNDS times into every linear tile (else the narrowest); 8 at batches >= 2 (not measured
    with others)."""
    if kernel_batch(cg) != 1:
        return 8
    sizes = _linear_tile_bytes(cg)
    for u in UNROLLS_BATCH1:
        if sizes and min(sizes) >= UNROLL_MIN_ROUNDS * worker_threads * u * LOAD_BYTES:
            return u
    return UNROLLS_BATCH1[-1]


COMPACT_CODE_UNROLL = 4
"""Batch-1 programs at this MPK_LINEAR_UNROLL build with the code-size variants (KernelShape.compact_code).
Measured on an H200 at context ~512 with v0.32's defaults (docs/PERF.md v0.33, two passes in one process):
qwen3-1.7b (unroll 4) 1.634 / 1.631 ms vs 1.652 / 1.649 (and as built by this rule: 1.638 / 1.639 vs 1.661 /
1.652), qwen3-0.6b (unroll 4) 1.044 / 1.043 vs 1.042 / 1.044;
at unroll 16 (the 8B presets) each variant was even or up to 0.3% slower (v0.32), so they stay off there."""


def default_compact_code(cg, linear_unroll: int) -> bool:
    """Whether program ``cg`` builds with the code-size variants when MPK_COMPACT_CODE is unset: batch 1 at
    COMPACT_CODE_UNROLL loads a lane (the small presets, whose short rows leave the entry's code size exposed)."""
    return kernel_batch(cg) == 1 and linear_unroll == COMPACT_CODE_UNROLL


WORKER_THREADS_WIDE, WORKER_THREADS_NARROW = 512, 256
"""Worker threads a block: 512 keeps twice the weight bytes in flight per SM (qwen3-8b b1 8.36 -> 6.32 ms with the
64 KB prefetch cap, docs/PERF.md v0.3); 256 for a batch-1 program whose smallest linear tile holds fewer than
UNROLL_MIN_ROUNDS rounds of the narrowest unroll at 512 (``default_worker_threads``)."""


def default_worker_threads(cg) -> int:
    """MPK_WORKER_THREADS for program ``cg`` (unset): WORKER_THREADS_NARROW at batch 1 when even the narrowest
    unroll's rounds at WORKER_THREADS_WIDE do not fit UNROLL_MIN_ROUNDS times into its smallest linear tile (the
    loads past a short tile's end are wasted slots, as with the unroll), else WORKER_THREADS_WIDE. Measured on an
    H200 at context ~512 (docs/PERF.md v0.23, one process per model, the same tokens): qwen3-0.6b (32 KB tiles)
    1.090 / 1.091 / 1.089 ms at 256 threads vs 1.129 / 1.130 / 1.129 at 512; qwen3-1.7b (64 KB tiles) stays at 512
    (1.683 / 1.684 vs 1.883 / 1.882 at 256 with 4 loads in flight, 1.826 with 8)."""
    if kernel_batch(cg) != 1:
        return WORKER_THREADS_WIDE
    sizes = _linear_tile_bytes(cg)
    narrowest = UNROLL_MIN_ROUNDS * WORKER_THREADS_WIDE * UNROLLS_BATCH1[-1] * LOAD_BYTES
    return WORKER_THREADS_NARROW if sizes and min(sizes) < narrowest else WORKER_THREADS_WIDE


MMA_MIN_BATCH = 3
"""Kernel batches from which the linear tiles run on tensor cores by default (MPK_LINEAR_MMA unset;
csrc/tasks/linear_mma.cuh). Measured on an H200: qwen3-8b tiles alone (docs/PERF.md v0.13, us) from batch 4 ahead
on every matrix (b4: qkv 18.73 vs 24.81, gate_up 57.86 vs 75.49, lm_head 350.20 vs 391.95), at batch 2 behind on
lm_head (353.06 vs 289.68); the whole qwen3-8b step at context ~512 (v0.29, one process, unsplit attention): batch 3
5.491 / 5.500 ms on tensor cores vs 6.549 / 6.537 scalar, batch 2 5.782 / 5.766 vs 5.762 / 5.693 (scalar kept)."""


def default_linear_mma(cg) -> bool:
    """Whether program ``cg``'s linear tiles run on tensor cores when MPK_LINEAR_MMA is unset: from
    MMA_MIN_BATCH rows a tile on (MPK_LINEAR_MMA=1 asks for them from 2 rows: csrc/tasks/linear.cuh compiles the
    tensor-core tile for MPK_BATCH >= 2 only)."""
    return kernel_batch(cg) >= MMA_MIN_BATCH


def padded_batch(batch: int) -> int:
    """The batch a mega-kernel program is compiled for: ``batch`` up to ROW_BLOCK, else the next
    multiple of ROW_BLOCK (the host fills the extra rows and drops their results)."""
    if not 1 <= batch <= MAX_BATCH:
        raise InputError(f"batch: expected 1..{MAX_BATCH} sequences, got {batch}")
    return batch if batch <= ROW_BLOCK else -(-batch // ROW_BLOCK) * ROW_BLOCK


def task_params(cg, task: int) -> dict[str, int]:
    """Parameters of one task by name (ints; float parameters as their int32 bits)."""
    row = cg.arrays["tasks"][task]
    kind = _kind_of(row)
    p = cg.arrays["params"][row[TASK_COLS["PARAM_BEGIN"]]:row[TASK_COLS["PARAM_END"]]]
    return {spec.name: int(v) for spec, v in zip(kind.params, p)}


def weight_block_bytes(cg, task: int) -> int:
    """Bytes of the contiguous [N_TILE, K] weight block a linear-kind task streams."""
    named = task_params(cg, task)
    return named["N_TILE"] * named["K"] * WEIGHT_BYTES


def _kind_of(row):
    from mpk_dist.taskgraph.tasks import BY_OPCODE

    return BY_OPCODE[int(row[TASK_COLS["OPCODE"]])]


def dependents(cg) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dep_ptr [E+1], dep_task [NW], dep_offset [NW]): who waits on event e, with which offset."""
    tasks, waits = cg.arrays["tasks"], cg.arrays["waits"]
    E = cg.arrays["events"].shape[0]
    owner = np.repeat(np.arange(tasks.shape[0]), tasks[:, TASK_COLS["WAIT_END"]] - tasks[:, TASK_COLS["WAIT_BEGIN"]])
    # wait rows are stored task by task in order, so row k belongs to owner[k]
    ev = waits[:, WAIT_COLS["EVENT"]]
    order = np.argsort(ev, kind="stable")
    ptr = np.zeros(E + 1, np.int64)
    np.add.at(ptr, ev + 1, 1)
    return (np.cumsum(ptr).astype(np.int32), owner[order].astype(np.int32),
            waits[order, WAIT_COLS["STEP_OFFSET"]].astype(np.int32))


def final_task(cg) -> int:
    """The argmax_select task (exactly one per step)."""
    ops = np.nonzero(cg.arrays["tasks"][:, TASK_COLS["OPCODE"]] == BY_NAME["argmax_select"].opcode)[0]
    if len(ops) != 1:
        raise InputError(f"task graph: expected exactly one argmax_select task, got {len(ops)}")
    return int(ops[0])


def check_supported(cg) -> None:
    """Raise InputError naming the first task whose shape the CUDA bodies do not support."""
    tasks = cg.arrays["tasks"]
    world = int(cg.meta["world_size"])
    if world > MAX_WORLD:
        raise InputError(f"tp: expected <= {MAX_WORLD} ranks in one mega-kernel group, got {world}")
    bad = [b for b in cg.meta["buffers"] if b["dtype"] == "f16" or (b["kind"] == "weight" and b["dtype"] != "bf16")]
    if bad:
        raise InputError(f"dtype: expected bf16 weights and activations, got {bad[0]['dtype']} for {bad[0]['name']}; "
                         "convert the checkpoint to bfloat16 (torch_dtype in config.json)")
    batch = int(cg.meta["batch"])
    if not 1 <= batch <= MAX_BATCH or (batch > ROW_BLOCK and batch % ROW_BLOCK):
        raise InputError(f"batch: expected 1..{ROW_BLOCK} or a multiple of {ROW_BLOCK} up to {MAX_BATCH} sequences "
                         f"(linear tiles hold {ROW_BLOCK} rows), got {batch}; "
                         + (f"pad the batch to {padded_batch(batch)}" if 1 <= batch <= MAX_BATCH else "split the batch"))
    check_linear_batch(cg)
    for t in range(tasks.shape[0]):
        kind = _kind_of(tasks[t]).name
        p = task_params(cg, t)
        if "BATCH" in p and not 1 <= p["BATCH"] <= MAX_BATCH:
            raise InputError(f"{cg.task_label(t)}: expected BATCH 1..{MAX_BATCH}, got {p['BATCH']}")
        if kind == "linear" and (p["K"] % 8 or p["X_STRIDE"] % 8):
            raise InputError(f"{cg.task_label(t)}: expected K and X_STRIDE multiples of 8 (16-byte loads), "
                             f"got K={p['K']}, X_STRIDE={p['X_STRIDE']}")
        if kind in ("attention", "attention_split", "attention_prep") and (p["GROUP"] > MAX_GROUP or p["HEAD_DIM"] > MAX_ATTN_HEAD_DIM):
            raise InputError(f"{cg.task_label(t)}: expected GROUP <= {MAX_GROUP} and head_dim <= {MAX_ATTN_HEAD_DIM}, "
                             f"got GROUP={p['GROUP']}, head_dim={p['HEAD_DIM']}")
        if kind == "qkv_prep" and (p["HEAD_DIM"] % 2 or p["HEAD_DIM"] > 512):
            raise InputError(f"{cg.task_label(t)}: expected an even head_dim <= 512, got {p['HEAD_DIM']}")


def check_linear_batch(cg) -> None:
    """Raise InputError naming the first linear-kind task whose BATCH differs from the kernel's
    (``kernel_batch``): its body would run MPK_BATCH rows past (or short of) the rows it owns."""
    kb = kernel_batch(cg)
    tasks = cg.arrays["tasks"]
    ops = tasks[:, TASK_COLS["OPCODE"]]
    for name in LINEAR_KINDS:
        kind = BY_NAME[name]
        rows = np.nonzero(ops == kind.opcode)[0]
        got = cg.arrays["params"][tasks[rows, TASK_COLS["PARAM_BEGIN"]] + kind.param_index("BATCH")]
        bad = np.nonzero(got != kb)[0]
        if len(bad):
            t = int(rows[bad[0]])
            raise InputError(f"{cg.task_label(t)}: expected BATCH {kb} (the kernel's compile-time rows, MPK_BATCH), "
                             f"got {int(got[bad[0]])}; batches above {ROW_BLOCK} rows must be multiples of {ROW_BLOCK} "
                             "(paged programs: compile for megakernel_paged.kernel_spec(spec))")


# Opt-in shared memory per block on sm_90 (227 KiB, dynamic + static), minus a margin for the static part.
HOPPER_MAX_DYNAMIC_SMEM = 227 * 1024
SMEM_RESERVE = 3072  # static: BlockState, the two task-record slots (768 B), RuntimeParams's copy, flags
RING_STAGES, RING_STAGE_BYTES = 4, 32 * 1024
WEIGHT_RING_BYTES = RING_STAGES * RING_STAGE_BYTES + 2 * RING_STAGES * 8 + 32
"""csrc/tasks/weight_stream.cuh's kRingBytes: stages, their full/empty mbarriers and the 32-byte RingState
(MPK_LINEAR_TMA)."""


INT32_BYTES = 4


def page_alloc_bytes(cg) -> int:
    """Shared memory of the page_alloc task (its per-slot and per-token arrays), 0 without one."""
    from mpk_dist.taskgraph.tasks.page_alloc import smem_words

    tasks = cg.arrays["tasks"]
    need = 0
    for t in np.nonzero(tasks[:, TASK_COLS["OPCODE"]] == BY_NAME["page_alloc"].opcode)[0]:
        p = task_params(cg, int(t))
        need = max(need, INT32_BYTES * smem_words(p["BATCH"], p["MAX_SEQS"]))
    return need


def kv_stage_fits(cg, worker_threads: int, weight_ring: bool = False) -> bool:
    """Whether the split-KV tiles' cache-row stage (lowering_attention.kv_stage_smem_bytes) fits the
    block's shared memory beside the weight ring; False without split-KV tiles."""
    from mpk_dist.taskgraph.lowering_attention import kv_stage_smem_bytes

    need = kv_stage_smem_bytes(cg, worker_threads)
    ring = WEIGHT_RING_BYTES if weight_ring else 0
    return 0 < need <= HOPPER_MAX_DYNAMIC_SMEM - SMEM_RESERVE - ring


MMA_PARTIAL_BYTES = 512
"""Shared memory of one split-K partial of an MMA linear tile (a 16 x 8 fp32 fragment: 32 lanes x 4 floats)."""
MMA_PARTIAL_PAIRS_PER_WARP = 4
"""(unit, slice) pairs a warp whose split-K partials the launch has room for above the largest staged operand.
csrc/tasks/linear_mma.cuh (mma_slices) deals a tile's pairs evenly over the warps and takes fewer slices where
the partials do not fit: qwen3-8b's batch-8 gate_up (24 units) and qkv (6 units) tiles take 3 pairs a warp, which
the staged rows alone (64 KB at batch 8) left no room for."""
MMA_PARTIAL_ALIGN = 128
"""Slack for aligning the partials (csrc: 16-byte float4 stores)."""


def mma_partial_room(cg, worker_threads: int, weight_ring: bool = False) -> int:
    """Dynamic shared memory that gives the MMA linear tiles MMA_PARTIAL_PAIRS_PER_WARP split-K partials a warp
    above the largest staged operand rows (the fused kinds' prologue), the weight ring after them."""
    from mpk_dist.taskgraph.fusion import staging_bytes

    ring = WEIGHT_RING_BYTES if weight_ring else 0
    limit = HOPPER_MAX_DYNAMIC_SMEM - SMEM_RESERVE - ring
    partials = MMA_PARTIAL_PAIRS_PER_WARP * MMA_PARTIAL_BYTES * (worker_threads // 32) + MMA_PARTIAL_ALIGN
    return min(limit, staging_bytes(cg, limit) + partials)


def smem_bytes(cg, worker_threads: int, weight_ring: bool = False, stage_kv: bool = False,
               linear_mma: bool = False, linear_unroll: int = 8, exact_partials: bool = True,
               attn_merge_phases: int = 1) -> int:
    """Dynamic shared memory per worker block: the largest need over the task bodies, plus the weight
    ring at the end when ``weight_ring`` (MPK_LINEAR_TMA; the staging budget shrinks by as much);
    ``stage_kv``: room for the split-KV tiles' cache-row stage when it fits (``kv_stage_fits``);
    ``linear_mma``: the linear tiles run on tensor cores, room for their split-K partials: with ``exact_partials``
    (MPK_MMA_PARTIAL_EXACT, default) the least that keeps every tile's slices (``mma_room.partial_room``, at the
    kernel's ``linear_unroll``), else a fixed ``mma_partial_room``; ``attn_merge_phases``: the unsplit attention
    tiles' block merge in that many phases (MPK_ATTN_MERGE_PHASES, with the kernel's phased merge:
    lowering_attention.merge_smem_bytes; the same bits, less shared memory)."""
    ring = WEIGHT_RING_BYTES if weight_ring else 0
    limit = HOPPER_MAX_DYNAMIC_SMEM - SMEM_RESERVE - ring  # what a block may take beside the ring
    from mpk_dist.taskgraph.fusion import staging_bytes
    from mpk_dist.taskgraph.lowering_attention import attention_staging_bytes
    from mpk_dist.taskgraph.lowering_attn_prep import split_prep_smem_bytes

    need = 2 * (worker_threads // 32) * 4  # block reductions (rms_norm, argmax)
    # Attention merges its warps' partials through shared memory (nwarps x GROUP x (D + 2) floats): the
    # unsplit kind, split-KV's staged path, and attention_prep tiles (the attn_prep fusion).
    for kind in ("attention", "attention_split", "attention_prep"):
        need = max(need, attention_staging_bytes(cg, kind, worker_threads, attn_merge_phases))
    # Fused linears stage their normalised / silu'd input rows in shared memory when it fits; a
    # tile that does not get the space recomputes per weight row (same bits, slower).
    need = max(need, staging_bytes(cg, limit))
    need = max(need, page_alloc_bytes(cg))
    need = max(need, split_prep_smem_bytes(cg, worker_threads))  # the attn_prep fusion in split programs
    if stage_kv and kv_stage_fits(cg, worker_threads, weight_ring):
        from mpk_dist.taskgraph.lowering_attention import kv_stage_smem_bytes

        need = max(need, kv_stage_smem_bytes(cg, worker_threads))
    from mpk_dist.taskgraph import flag_words

    flags = flag_words.smem_bytes(cg)  # the polling norm tiles' gathered rows (0 without flagged copies)
    need = max(need, flags)
    if linear_mma:
        fixed = _round_launch(max(need, mma_partial_room(cg, worker_threads, weight_ring)))
        # Exact room: the slices every tile takes at the fixed room, in no more bytes than they use. Not with
        # flagged copies, whose staged linear_residual tiles keep bytes the mirror does not model.
        if exact_partials and not flags:
            from mpk_dist.runtime.mma_room import partial_room

            need = max(need, partial_room(cg, worker_threads, linear_unroll, fixed))
        else:
            need = fixed
    return _round_launch(need) + ring


def _round_launch(nbytes: int) -> int:
    """Dynamic shared memory as the launch asks for it: a multiple of 128 bytes."""
    return (nbytes + 127) // 128 * 128


def max_tasks_per_worker(cg) -> int:
    """Longest static list (bounds the jit queues)."""
    return int(np.diff(cg.arrays["worker_offsets"]).max(initial=0))
