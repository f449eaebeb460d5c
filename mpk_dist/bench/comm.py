"""Communication micro-benchmark between GPUs: our flag ping-pong and one-shot all-reduce
(csrc/bench/comm_bench.cu, the mega-kernel's transport) against NCCL through torch.distributed.

One process per GPU under MPI (``launch/mpirun.sh -n 2 bench-comm``). Each rank measures, rank 0
gathers (bounded) and prints an nccl-tests-like table, maximum over ranks of each figure:

* ``allreduce eager``: one launch (ours) / one ``dist.all_reduce`` (NCCL) per call, CUDA events.
* ``allreduce graph``: a CUDA graph of K calls, replayed; time per call.
* ``allreduce in-kernel``: ITERS all-reduces inside ONE launch of ours (globaltimer), against
  NCCL's graph figure (its cheapest per call).
* ``pingpong one-way``: ranks 0 and 1 bounce a flag ITERS times; total / (2 ITERS).

Inputs are exact in bf16 and so are all partial sums (multiples of 1/8, |x| <= 1), so our result
must equal the fp32 rank-order sum bit for bit, and NCCL's must too within bf16 rounding.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from mpk_dist.bench.comm_report import (build_record, combine_ranks, compare, format_table, nccl_tolerance,
                                        preamble)
from mpk_dist.errors import BackendUnavailable, DeviceTimeout, InputError
from mpk_dist.runtime.build import CSRC

KERNEL_SOURCE = CSRC / "bench" / "comm_bench.cu"  # repo checkout or installed package (mpk_dist/csrc)
# Layout of the symmetric buffer and of the local status words: passed to the kernel as -D
# defines, so this dict is the one place it is written (csrc/bench/comm_bench.cu reads CB_*).
LAYOUT = {
    "CB_PP_FLAG_OFF": 0,      # bytes: uint32 ping-pong flag that the PEER writes
    "CB_AR_FLAG_OFF": 256,    # bytes: uint32 [CB_MAX_BLOCKS][CB_MAX_WORLD] all-reduce flags
    "CB_RECV_OFF": 4096,      # bytes: bf16 [2 parities][world][n] receive slots
    "CB_MAX_WORLD": 8,
    "CB_MAX_BLOCKS": 16,
    "CB_ST_TIMES": 8,         # status words: uint64 start, end (globaltimer ns)
    "CB_ST_AR_EPOCH": 16,     # status words: all-reduce epoch of each block
    "CB_ST_PP_EPOCH": 48,     # status word: ping-pong counter
}
STATUS_WORDS = 64
BLOCK_THREADS = 256
ERROR_CODES = {1: "ping-pong flag", 2: "all-reduce flag"}
MAX_SIZE_BYTES = 16 << 20
# Argument (name, bytes) of each kernel, in order: tests/bench/test_comm.py checks them against the
# signatures in comm_bench.cu, since a wrong size would be read as garbage by the kernel.
KERNEL_ARGS = {
    "comm_pingpong": (("peers", 8), ("rank", 4), ("iters", 4), ("timed_from", 4), ("timeout_ns", 8), ("status", 8)),
    "comm_allreduce": (("peers", 8), ("in", 8), ("out", 8), ("rank", 4), ("world", 4), ("n", 4), ("iters", 4),
                       ("timed_from", 4), ("timeout_ns", 8), ("status", 8)),
}


@dataclass(frozen=True)
class CommOptions:
    """What to measure; see ``check_options`` for the valid ranges."""

    size_bytes: int = 16384
    iters: int = 1000
    warmup: int = 20
    graph_len: int = 100
    timeout_s: float = 30.0
    output_json: str | None = None


def check_options(opts: CommOptions) -> None:
    """Raise InputError naming the flag when a value is out of range."""
    for flag, value in (("--iters", opts.iters), ("--graph-len", opts.graph_len)):
        if value < 1:
            raise InputError(f"{flag}: expected a positive integer, got {value}")
    if opts.warmup < 0:
        raise InputError(f"--warmup: expected >= 0, got {opts.warmup}")
    if not opts.timeout_s > 0:
        raise InputError(f"--timeout: expected a positive number of seconds, got {opts.timeout_s}")
    if opts.size_bytes < 256 or opts.size_bytes % 256 or opts.size_bytes > MAX_SIZE_BYTES:
        raise InputError(f"--size-bytes: expected a multiple of 256 in [256, {MAX_SIZE_BYTES}], got "
                         f"{opts.size_bytes}; e.g. --size-bytes 16384")


def check_world(world_size: int, source: str) -> None:
    """bench-comm needs 2..CB_MAX_WORLD ranks, one process per GPU, under MPI."""
    if world_size < 2:
        raise InputError(f"bench-comm: expected >= 2 MPI ranks (one per GPU), got {world_size} ({source}); "
                         "run: launch/mpirun.sh -n 2 bench-comm")
    if world_size > LAYOUT["CB_MAX_WORLD"]:
        raise InputError(f"bench-comm: expected at most {LAYOUT['CB_MAX_WORLD']} ranks, got {world_size}; "
                         f"run launch/mpirun.sh -n {LAYOUT['CB_MAX_WORLD']} bench-comm")


def check_gpu(available: bool, rank: int) -> None:
    """Refuse a rank that sees no CUDA device."""
    if not available:
        raise BackendUnavailable(f"bench-comm: expected a CUDA GPU on rank {rank}, got none (torch.cuda.is_available() "
                                 "is False); run on a GPU node")


def check_distinct_gpus(uuids: list[str]) -> None:
    """Refuse ranks that share a GPU (NCCL refuses them, and the latency would be meaningless)."""
    first: dict[str, int] = {}
    for r, u in enumerate(uuids):
        if u in first:
            raise InputError(f"bench-comm: expected one GPU per rank, got ranks {first[u]} and {r} on GPU {u}; "
                             f"start at most as many ranks as GPUs (launch/mpirun.sh -n <number of GPUs> bench-comm)")
        first[u] = r


def ar_blocks(n: int) -> int:
    """Blocks of the all-reduce kernel for n bf16: up to CB_MAX_BLOCKS, >= 512 elements each."""
    blocks = max(1, min(LAYOUT["CB_MAX_BLOCKS"], n // 512))
    while n % (8 * blocks):  # each block's column block is whole 16-byte vectors
        blocks -= 1
    return blocks


def rank_input(rank: int, n: int):
    """Rank r's vector: multiples of 1/8 in [-1, 1], different per rank (bf16 [n], CPU)."""
    import torch

    i = torch.arange(n, dtype=torch.int64)
    return (((i * 7 + rank * 13 + (i // 97) * rank) % 17 - 8).float() / 8).to(torch.bfloat16)


def expected_sum(world: int, n: int):
    """The fp32 sum in rank order of every rank's input, rounded to bf16 (CPU)."""
    import torch

    total = torch.zeros(n, dtype=torch.float32)
    for r in range(world):
        total += rank_input(r, n).float()
    return total.to(torch.bfloat16)


def timeout_message(status: list[int], timeout_s: float) -> str:
    """The one-line error for a kernel error record (comm_bench.cu record_timeout)."""
    code, block, peer, expected, seen, it, rank = status[:7]
    what = ERROR_CODES.get(code, f"error code {code}")
    where = f" of block {block}" if code == 2 else ""
    return (f"bench-comm: rank {rank} waited on its {what}{where} written by rank {peer}: expected >= {expected}, "
            f"got {seen} after {timeout_s:g} s (iteration {it}); rank {peer} stalled or died earlier "
            "(see its output); --timeout raises the limit")


def pack_args(kernel: str, **values: int) -> list:
    """ctypes values of ``kernel``'s arguments in order (KERNEL_ARGS); every argument must be given."""
    spec = KERNEL_ARGS[kernel]
    names = [n for n, _ in spec]
    if sorted(values) != sorted(names):
        raise ValueError(f"{kernel} arguments: expected {names}, got {sorted(values)}")
    return [(ctypes.c_uint64 if size == 8 else ctypes.c_int32)(int(values[name])) for name, size in spec]


def build_kernel(compiler: str | None = None, use_cache: bool = True):
    """Compile comm_bench.cu with the LAYOUT defines (cached by content; mpk_dist.runtime.build)."""
    from mpk_dist.runtime.build import compile_source

    return compile_source(KERNEL_SOURCE.read_text(), "comm_bench", defines=LAYOUT, compiler=compiler, use_cache=use_cache)


class CommKernels:
    """The loaded comm_bench module: launches of comm_pingpong and comm_allreduce."""

    def __init__(self, cubin: bytes, device_index: int):
        import numpy as np
        from cuda.bindings import driver as cu

        from mpk_dist.runtime.loader import _check, ensure_context

        ensure_context(device_index)
        self._check = _check
        self._keep = np.frombuffer(cubin, dtype=np.uint8).copy()
        self.module = _check(cu.cuModuleLoadData(self._keep.ctypes.data), "cuModuleLoadData(comm_bench)")
        self.pingpong = _check(cu.cuModuleGetFunction(self.module, b"comm_pingpong"), "cuModuleGetFunction(comm_pingpong)")
        self.allreduce = _check(cu.cuModuleGetFunction(self.module, b"comm_allreduce"), "cuModuleGetFunction(comm_allreduce)")

    def launch(self, func, grid: int, block: int, args: list, stream: int) -> None:
        """cuLaunchKernel with ctypes scalars as the arguments (the driver copies them at launch)."""
        from cuda.bindings import driver as cu

        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self._check(cu.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, 0, cu.CUstream(stream), ctypes.addressof(ptrs), 0),
                    "cuLaunchKernel(comm_bench)")


def raise_on_error(status, timeout_s: float) -> None:
    """DeviceTimeout when the kernel recorded a timeout in ``status`` (uint32 words, device)."""
    words = [int(w) & 0xFFFFFFFF for w in status[:8].cpu().tolist()]
    if words[0] != 0:
        raise DeviceTimeout(timeout_message(words, timeout_s))


# ---- the run on one rank (GPU, under MPI) ------------------------------------------------------
@dataclass
class _Rank:
    """This rank's state: who it is, its GPU, the bench kernels and buffers."""

    rank: int
    world: int
    comm: Any
    device: Any
    kernels: CommKernels
    buf: Any      # SymmetricBuffer
    peers: Any    # int64 [world] on the device: the kernels' peer table
    status: Any   # int32 [STATUS_WORDS] on the device: error record, times, epochs
    timeout_s: float

    def barrier(self, what: str) -> None:
        """Every rank arrives, or DeviceTimeout names the missing ones (bounded)."""
        from mpk_dist.dist.gather import allgather

        allgather(what, comm=self.comm, timeout_s=self.timeout_s)

    def stream(self) -> int:
        """The current torch stream (the capture stream while a CUDA graph is captured)."""
        import torch

        return torch.cuda.current_stream().cuda_stream

    def args(self, kernel: str, **values: int) -> list:
        """``kernel``'s ctypes arguments; the peer table, rank, timeout and status are filled in."""
        return pack_args(kernel, peers=self.peers.data_ptr(), rank=self.rank, timeout_ns=int(self.timeout_s * 1e9),
                         status=self.status.data_ptr(), **values)

    def times_us(self, count: int) -> float:
        """(end - start) of the last launch's timed part, per ``count`` events, in us."""
        import torch

        t = self.status[LAYOUT["CB_ST_TIMES"]:LAYOUT["CB_ST_TIMES"] + 4].cpu().view(torch.int64).tolist()
        return (t[1] - t[0]) / 1e3 / count

    def check(self) -> None:
        """Wait for the kernels, then raise DeviceTimeout if one recorded a timeout."""
        import torch

        torch.cuda.synchronize(self.device)  # bounded: every kernel wait has timeout_ns
        raise_on_error(self.status, self.timeout_s)


def setup_rank(opts: CommOptions) -> _Rank:
    """Rank, GPU (one per rank), compiled kernels and the IPC-mapped symmetric buffers."""
    import torch

    from mpk_dist.comm.symmetric import allocate_ipc
    from mpk_dist.dist.env import rank_info, select_device
    from mpk_dist.dist.gather import allgather, world_comm
    from mpk_dist.runtime.transport import device_uuid

    info = rank_info()
    check_world(info.world_size, "started without an MPI launcher" if info.source == "single" else info.source)
    check_gpu(torch.cuda.is_available(), info.rank)
    device = torch.device("cuda", select_device(info))
    torch.cuda.set_device(device)
    comm = world_comm()
    check_distinct_gpus(allgather(device_uuid(device), comm=comm, timeout_s=opts.timeout_s))
    kernels = CommKernels(build_kernel().cubin, device.index)
    nbytes = LAYOUT["CB_RECV_OFF"] + 2 * info.world_size * opts.size_bytes
    buf = allocate_ipc(nbytes, device, comm, info.rank, info.world_size, timeout_s=opts.timeout_s)
    status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)
    return _Rank(info.rank, info.world_size, comm, device, kernels, buf, buf.peer_table(), status, opts.timeout_s)


def _events_us(fn, calls: int) -> float:
    """Time ``calls`` calls of ``fn`` on the current stream with CUDA events; us per call."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _graph_us(fn, graph_len: int, replays: int) -> float:
    """Capture ``graph_len`` calls of ``fn`` in a CUDA graph, replay it; us per call."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_len):
            fn()
    graph.replay()  # warm: first replay uploads the graph
    torch.cuda.synchronize()
    return _events_us(graph.replay, replays) / graph_len


def run_pingpong(r: _Rank, opts: CommOptions) -> tuple[float | None, tuple[bool, str]]:
    """One launch of warmup + iters round trips on ranks 0 and 1; (one-way us on rank 0, check)."""
    r.barrier("pingpong start")
    if r.rank > 1:
        return None, (True, "pingpong: not a party (ranks 0 and 1)")
    lead = max(1, opts.warmup)
    before = int(r.status[LAYOUT["CB_ST_PP_EPOCH"]])
    r.kernels.launch(r.kernels.pingpong, 1, 32,
                     r.args("comm_pingpong", iters=lead + opts.iters, timed_from=lead), r.stream())
    r.check()
    moved = int(r.status[LAYOUT["CB_ST_PP_EPOCH"]]) - before
    ok = moved == lead + opts.iters
    detail = "pingpong: OK" if ok else f"pingpong: expected {lead + opts.iters} round trips, got {moved}"
    return (r.times_us(2 * opts.iters) if r.rank == 0 else None), (ok, detail)


def run_ours(r: _Rank, opts: CommOptions, x, out, want) -> tuple[dict[str, float], dict[str, tuple[bool, str]]]:
    """Our all-reduce: in-kernel (one launch), eager launches, CUDA graph of launches."""
    import torch

    n = x.numel()
    grid = ar_blocks(n)

    def args(iters: int, timed_from: int) -> list:
        return r.args("comm_allreduce", **{"in": x.data_ptr()}, out=out.data_ptr(), world=r.world, n=n, iters=iters,
                      timed_from=timed_from)

    one = args(1, 1)  # NOTE: the same arguments every call (epochs live on the device), packed once

    def launch(a: list = one) -> None:
        r.kernels.launch(r.kernels.allreduce, grid, BLOCK_THREADS, a, r.stream())

    times, checks = {}, {}
    lead = max(1, opts.warmup)
    r.barrier("ours in-kernel")
    out.fill_(float("nan"))
    launch(args(lead + opts.iters, lead))
    r.check()
    times["ours_inkernel_us"] = r.times_us(opts.iters)
    checks["ours in-kernel"] = compare("ours in-kernel", out, want)
    for _ in range(opts.warmup):
        launch()
    r.check()
    checks["ours fresh slots"] = _fresh_slots_check(r, launch, out, want)
    r.barrier("ours eager")
    out.fill_(float("nan"))
    times["ours_eager_us"] = _events_us(launch, opts.iters)
    r.check()
    checks["ours eager"] = compare("ours eager", out, want)
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    r.barrier("ours graph")
    times["ours_graph_us"] = _graph_us(launch, opts.graph_len, max(1, opts.iters // opts.graph_len))
    r.check()
    checks["ours graph"] = compare("ours graph", out, want)
    return times, checks


def _fresh_slots_check(r: _Rank, launch, out, want) -> tuple[bool, str]:
    """One all-reduce into zeroed receive slots: a rank that summed before its peers' data arrived
    (a broken flag wait) reads zeros, which the repeated calls (same data every time) would hide."""
    r.buf.local[LAYOUT["CB_RECV_OFF"]:].zero_()
    out.fill_(float("nan"))
    r.check()
    r.barrier("ours fresh slots")  # nobody pushes before every rank has zeroed its slots
    launch()
    r.check()
    return compare("ours fresh slots", out, want)


def run_nccl(r: _Rank, opts: CommOptions, x, ours_out, want) -> tuple[dict[str, float], dict[str, tuple[bool, str]]]:
    """NCCL through torch.distributed on the same vector: eager calls and a CUDA graph of calls."""
    import torch.distributed as dist

    from mpk_dist.backends.torch_dist import init_process_group

    init_process_group(r.rank, r.world, r.device)
    y = x.clone()
    dist.all_reduce(y)
    tol = nccl_tolerance(r.world)
    checks = {"nccl eager": compare("nccl eager", y, want, tol), "ours vs nccl": compare("ours vs nccl", ours_out, y, tol)}
    for _ in range(opts.warmup):
        dist.all_reduce(y)
    r.barrier("nccl eager")
    times = {"nccl_eager_us": _events_us(lambda: dist.all_reduce(y), opts.iters)}
    r.barrier("nccl graph")
    times["nccl_graph_us"] = _graph_us(lambda: dist.all_reduce(y), opts.graph_len, max(1, opts.iters // opts.graph_len))
    return times, checks


def measure_rank(opts: CommOptions) -> tuple[_Rank, dict[str, Any]]:
    """Every measurement of this rank, as one dict (timings in us, checks as (ok, detail))."""
    r = setup_rank(opts)
    n = opts.size_bytes // 2
    x = rank_input(r.rank, n).to(r.device)
    out = x.new_empty(n)
    want = expected_sum(r.world, n)
    pp_us, pp_check = run_pingpong(r, opts)
    ours, ours_checks = run_ours(r, opts, x, out, want)
    nccl, nccl_checks = run_nccl(r, opts, x, out, want)
    return r, {"rank": r.rank, "pingpong_us": pp_us, **ours, **nccl,
               "checks": {"pingpong": pp_check, **ours_checks, **nccl_checks}}


def run(opts: CommOptions) -> int:
    """The whole benchmark on this rank; rank 0 prints the table (and writes JSON). 0 when all OK."""
    check_options(opts)
    r, mine = measure_rank(opts)
    from mpk_dist.bench.environment import collect_environment
    from mpk_dist.bench.results import write_result
    from mpk_dist.dist.gather import gather_to_rank0

    try:
        per_rank = gather_to_rank0(mine, comm=r.comm, timeout_s=opts.timeout_s)
    finally:
        _teardown(r)
    if per_rank is None:
        return 0
    rows, failures = combine_ranks(per_rank, opts.size_bytes)
    env = collect_environment()
    print(format_table(rows, failures, preamble(opts, r.world, env)), flush=True)
    record = build_record(rows, failures, per_rank, opts, env)
    if opts.output_json:
        write_result(record, opts.output_json)
    return 0 if record["ok"] else 1


def _teardown(r: _Rank) -> None:
    """Leave NCCL and unmap the peers' buffers."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    r.buf.close()
