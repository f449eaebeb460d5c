"""Load a cubin and launch the persistent kernel with cuda-python (cuda.bindings.driver).

torch owns the CUDA context (its primary context on the device); this module only loads a module
into it, sizes the grid with the occupancy API and launches cooperatively, which fails loudly
instead of deadlocking when the grid cannot be co-resident.
"""

from __future__ import annotations

import ctypes

import numpy as np

from mpk_dist.errors import BackendUnavailable

KERNEL_NAME = b"mpk_megakernel"


def _check(result, what: str):
    """Unpack a cuda-python (err, *values) tuple; raise on error."""
    from cuda.bindings import driver as cu

    err, *vals = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise BackendUnavailable(f"{what}: expected CUDA_SUCCESS, got {name.decode() if name else err}")
    return vals[0] if len(vals) == 1 else (tuple(vals) if vals else None)


def ensure_context(device_index: int) -> None:
    """Make torch's primary context current on this thread (cuda.bindings needs a current context)."""
    import torch
    from cuda.bindings import driver as cu

    torch.cuda.set_device(device_index)
    torch.empty(1, device=f"cuda:{device_index}")  # forces torch to create/bind the primary context
    _check(cu.cuInit(0), "cuInit")
    ctx = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        dev = _check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


SM_MAX_SHARED_BYTES = 228 * 1024
"""Shared memory of an sm_90 SM's largest carveout (of its 256 KB unified L1 / shared memory)."""
BLOCK_RESERVED_SHARED_BYTES = 1024
"""Shared memory the driver reserves per resident block (sm_80+)."""


def carveout_percent(block_shared_bytes: int) -> int:
    """The smallest preferred-carveout percentage whose shared memory holds one block's ``block_shared_bytes``
    (dynamic + static) plus the driver's reservation: the driver rounds it up to a supported configuration, and
    what the SM does not give to shared memory is L1 data cache (MPK_MIN_CARVEOUT; measured within 0.3% of the
    driver's choice at context ~512 once the runtime parameters moved to shared memory: docs/PERF.md v0.10)."""
    need = block_shared_bytes + BLOCK_RESERVED_SHARED_BYTES
    return min(100, max(0, -(-100 * need // SM_MAX_SHARED_BYTES)))


class LoadedKernel:
    """A loaded mega-kernel function and how to launch it."""

    def __init__(self, cubin: bytes, device_index: int, block_threads: int, smem_bytes: int,
                 min_carveout: bool = False):
        from cuda.bindings import driver as cu

        ensure_context(device_index)
        self._keep = np.frombuffer(cubin, dtype=np.uint8).copy()
        self.module = _check(cu.cuModuleLoadData(self._keep.ctypes.data), "cuModuleLoadData")
        self.func = _check(cu.cuModuleGetFunction(self.module, KERNEL_NAME), "cuModuleGetFunction")
        self.block_threads, self.smem_bytes = block_threads, smem_bytes
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(cu.cuFuncSetAttribute(self.func, attr, smem_bytes), "cuFuncSetAttribute(max dynamic smem)")
        if min_carveout:  # the rest of the SM's 256 KB is L1 data cache (see carveout_percent)
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            static = int(_check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                                      self.func), "cuFuncGetAttribute(static smem)"))
            _check(cu.cuFuncSetAttribute(self.func, attr, carveout_percent(smem_bytes + static)),
                   "cuFuncSetAttribute(preferred carveout)")
        dev = _check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        sm_attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        self.num_sms = int(_check(cu.cuDeviceGetAttribute(sm_attr, dev), "cuDeviceGetAttribute(SM count)"))
        self.blocks_per_sm = int(_check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.func, block_threads, smem_bytes),
                                        "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def max_coresident(self) -> int:
        """Blocks that can be resident at once (occupancy x SMs)."""
        return self.blocks_per_sm * self.num_sms

    def launch(self, grid: int, params_ptr: int, stream_handle: int, cooperative: bool = True) -> None:
        """Launch ``grid`` blocks with one argument (the RuntimeParams address).

        ``cooperative``: the driver checks that the grid is co-resident and refuses otherwise (one
        kernel on the GPU). A TP group of several kernels on one GPU launches plainly: a cooperative
        launch checks each grid against the WHOLE GPU, not against its peers, so the group checks
        the sum itself (mpk_dist.runtime.partition.check_coresident) before launching.
        """
        from cuda.bindings import driver as cu

        if grid > self.max_coresident():
            raise BackendUnavailable(f"mega-kernel grid: expected <= {self.max_coresident()} co-resident blocks "
                                     f"({self.blocks_per_sm}/SM x {self.num_sms} SMs), got {grid}; "
                                     "compile the task graph for fewer workers")
        arg = np.array([params_ptr], dtype=np.uint64)
        argv = np.array([arg.ctypes.data], dtype=np.uint64)
        call = cu.cuLaunchCooperativeKernel if cooperative else cu.cuLaunchKernel
        tail = () if cooperative else (0,)  # cuLaunchKernel also takes `extra` (none here)
        _check(call(self.func, grid, 1, 1, self.block_threads, 1, 1, self.smem_bytes, cu.CUstream(stream_handle),
                    argv.ctypes.data, *tail),
               "cuLaunchCooperativeKernel" if cooperative else "cuLaunchKernel")
        self._last_args = (arg, argv)  # keep alive until the launch has read them


def host_device_pointer(host_ptr: int) -> int:
    """Device address of pinned host memory (equal to the host address under UVA)."""
    from cuda.bindings import driver as cu

    err, dptr = cu.cuMemHostGetDevicePointer(host_ptr, 0)
    return int(dptr) if err == cu.CUresult.CUDA_SUCCESS else int(host_ptr)


def c_bytes(obj) -> bytes:
    """Raw bytes of a ctypes object."""
    return ctypes.string_at(ctypes.addressof(obj), ctypes.sizeof(obj))
