"""GPU tests of the wait inside the body (-DMPK_LOAD_BEFORE_WAIT=1, csrc/runtime/body_wait.cuh): batch-1 o_proj
tiles behind a narrow attention op issue their first round of weight loads, then wait for their inputs.

- The logits equal the default build's bit for bit (the same loads and sums, only the wait moved), on qwen3-0.6b
  with unsplit attention (``attn_splits=1``: 8 attention tiles, so the host flags the o_proj tiles).
- A producer that never signals still gives the watchdog's error naming it, when the waiting tile is a flagged one.

Run: ``python -m pytest -q -m gpu tests/runtime/test_body_wait_gpu.py`` (about a minute on an H200).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.errors import DeviceTimeout  # noqa: E402
from mpk_dist.runtime.megakernel_backend import scoped_env  # noqa: E402
from mpk_dist.runtime.task_records import FLAG_LOAD_BEFORE_WAIT, REC_FLAGS  # noqa: E402
from mpk_dist.runtime.testing import check_bitwise, forced_request, megakernel_with_env  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
FLAGS = "-DMPK_LOAD_BEFORE_WAIT=1"


def session_built_with(backend, batch: int, flags: str):
    """``backend``'s session for ``batch``, its kernel built under MPK_NVCC_EXTRA_FLAGS = ``flags`` (read when the
    session is made)."""
    with scoped_env({"MPK_NVCC_EXTRA_FLAGS": flags}):
        return backend.session(batch)


def flagged(session) -> int:
    """How many of the session's task records carry FLAG_LOAD_BEFORE_WAIT."""
    return int(((session.records.cpu()[:, REC_FLAGS] & FLAG_LOAD_BEFORE_WAIT) != 0).sum())


def test_body_wait_leaves_the_logits_bitwise(gpu_results):
    name = "qwen3-0.6b"
    variant = megakernel_with_env(name, {"MPK_NVCC_EXTRA_FLAGS": FLAGS}, attn_splits=1)
    default = megakernel_with_env(name, {}, attn_splits=1)
    on, off = session_built_with(variant, 1, FLAGS), session_built_with(default, 1, "")
    assert on.build.path != off.build.path, f"{FLAGS} did not make another binary"
    assert flagged(on) >= 64, "expected the o_proj tiles behind the 8 attention tiles flagged"
    check_bitwise(f"{FLAGS} vs default, {name} b1 unsplit prompt 200", name, variant, default,
                  forced_request(name, 200, 48, 1, 70), gpu_results)


def test_watchdog_names_the_producer_when_the_body_waits(gpu_results):
    """The tiny preset's attention tile hangs (never signals): the flagged o_proj tiles wait inside their body and
    the host error still names the waiting task, the event, the step and the root cause."""
    probe = megakernel_with_env("tiny", {"MPK_NVCC_EXTRA_FLAGS": FLAGS})
    cg = session_built_with(probe, 1, FLAGS).cg
    assert flagged(probe.session(1)) > 0, "expected flagged o_proj tiles in the tiny program"
    victim = next(t for t in range(cg.arrays["tasks"].shape[0]) if "L0.attention" in cg.task_label(t))
    b = megakernel_with_env("tiny", {"MPK_NVCC_EXTRA_FLAGS": FLAGS}, timeout_s=0.5, inject_hang_task=victim)
    session_built_with(b, 1, FLAGS)
    t0 = time.perf_counter()
    with pytest.raises(DeviceTimeout) as info:
        b.generate(GenerateRequest([[1, 2, 3]], 8))
    msg, took = str(info.value), time.perf_counter() - t0
    gpu_results.append({"case": "watchdog, body wait", "steps": "-", "ok": "waited on event" in msg and took < 30})
    print(msg)
    assert "waited on event" in msg and "at step 0" in msg and " SM " in msg, msg
    assert f"root cause: {cg.task_label(victim)}" in msg, msg
    assert took < 30
