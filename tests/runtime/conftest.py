"""GPU test results table: tests append rows to ``RESULTS``; printed at the end of the session and
written as JSON to $MPK_GPU_REPORT when set (scripts/gpu_check.sh reads it)."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

# ---- fakes of the GPU parts, for CPU tests of the host side ----------------------------------------
class FakeKernel:
    blocks_per_sm, num_sms = 1, 8

    def __init__(self, cubin, device_index, block_threads, smem, min_carveout=False):
        self.block_threads, self.smem, self.launches = block_threads, smem, []

    def launch(self, grid, params_ptr, stream, cooperative=True):
        self.launches.append((grid, params_ptr, cooperative))


class FakeStream:
    cuda_stream = 0

    def query(self):
        return True

    def synchronize(self):
        pass


def fake_wait(self, on_step=None):
    """What the device would leave behind for steps s0..s1-1 (token t = step, 1 ms per step, logits
    dump rows filled with rank + 1)."""
    s0, s1 = self._steps
    self.pinned["token_out"][s0:s1] = torch.arange(s0, s1, dtype=torch.int32)[:, None]
    self.pinned["step_end_ns"][s0:s1 + 1] = torch.arange(s0, s1 + 1) * 1_000_000
    self.pinned["progress"][0] = s1
    if self.logits_dump is not None:
        self.logits_dump.fill_(float(self.rank + 1))


@pytest.fixture()
def fake_gpu(monkeypatch):
    """Patch the GPU-only parts (kernel build/load, streams, SM count, device check) away; returns
    mpk_dist.runtime.megakernel_backend. CPU tests of the host side of launches use it."""
    from mpk_dist.runtime import megakernel_backend as MB
    from mpk_dist.runtime import session as S

    monkeypatch.setattr(S, "build_kernel", lambda *a, **k: ("src", types.SimpleNamespace(cubin=b"", cached=True,
                                                                                          compiler="fake", path="x")))
    monkeypatch.setattr(S, "LoadedKernel", FakeKernel)
    monkeypatch.setattr(S, "host_device_pointer", lambda p: p)
    monkeypatch.setattr(S.Session, "_stream", lambda self: FakeStream())
    monkeypatch.setattr(S.Session, "wait", fake_wait)
    monkeypatch.setattr(S.Session, "finished", lambda self: fake_wait(self) or True)
    monkeypatch.setattr(MB.MegakernelBackend, "_check_device", lambda self: None)
    monkeypatch.setattr(MB.MegakernelBackend, "_num_sms", lambda self: 8)
    return MB


# ---- GPU result rows ----------------------------------------------------------------------------
class _Rows(list):
    """Result rows; each append is also written to $MPK_GPU_REPORT at once (a run cut short by a
    time limit still leaves the rows it finished)."""

    def append(self, row: dict) -> None:
        super().append(row)
        path = os.environ.get("MPK_GPU_REPORT")
        if path:
            with open(path, "w") as f:
                json.dump(list(self), f, indent=1)


RESULTS: list[dict] = _Rows()


@pytest.fixture()
def tune_sweep() -> types.ModuleType:
    """scripts/tune_sweep.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("tune_sweep", Path(__file__).resolve().parents[2] / "scripts" /
                                                  "tune_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def gpu_results() -> list[dict]:
    """The session's result rows (append one dict per checked case)."""
    return RESULTS


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the rows recorded by GPU tests as a short table."""
    if not RESULTS:
        return
    tr = terminalreporter
    tr.write_sep("=", "mega-kernel GPU results")
    keys = ["case", "steps", "max_err/std", "argmax_agree", "tokens_equal", "ms/token", "ok"]
    tr.write_line(" ".join(f"{k:>14}" if i else f"{k:<34}" for i, k in enumerate(keys)))
    for r in RESULTS:
        cells = [str(r.get(k, "-")) for k in keys]
        tr.write_line(" ".join(f"{c:>14}" if i else f"{c:<34}" for i, c in enumerate(cells)))
    path = os.environ.get("MPK_GPU_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)
