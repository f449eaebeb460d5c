"""GPU test results table: tests append rows to ``RESULTS``; printed at the end of the session and
written as JSON to $MPK_GPU_REPORT when set (scripts/gpu_check.sh reads it)."""

from __future__ import annotations

import json
import os

import pytest

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
