"""tests/nvcc_offload.py finds the nvcc build tests by their skip mark's reason: every such mark in the suite must
use it, or its test stays in the main process (slower CI, not a skipped check)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.nvcc_offload import NVCC_SKIP_REASON

NVCC_SKIP = re.compile(r'skipif\([^\n]*which\("nvcc"\) is None,\s*reason="([^"]*)"')


def test_every_nvcc_skip_mark_is_one_the_offload_finds():
    reasons = {}
    for path in Path(__file__).parent.rglob("*.py"):
        for reason in NVCC_SKIP.findall(path.read_text()):
            reasons.setdefault(reason, []).append(path.name)
    assert len(reasons) >= 1 and sum(map(len, reasons.values())) >= 10, reasons  # the suite's ~17 files
    odd = {r: files for r, files in reasons.items() if not r.startswith(NVCC_SKIP_REASON)}
    assert not odd, f"nvcc skip reasons the offload does not recognise (expected a start of {NVCC_SKIP_REASON!r}): {odd}"
