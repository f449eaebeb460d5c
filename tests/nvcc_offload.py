"""The nvcc build tests in a second pytest process, beside the rest of the suite (pytest hooks; tests/conftest.py
imports them).

Why: ~20 tests compile the whole mega-kernel with nvcc (20-50 s each, single-threaded), about half of the suite's
wall time on the 2-core CI machine, while the rest of the suite is one Python process: the second core idles. Here
the tests marked by the `needs_nvcc` skip (reason starting with ``NVCC_SKIP_REASON``) are taken out of this session
at collection and run by ``python -m pytest`` in a child process started at once; the session waits for it at the
end, prints its summary (its whole output when it failed) and fails when it failed. Nothing is offloaded when
nvcc is missing (those tests skip), in a session with GPU tests (they want the machine to themselves), with fewer
than ``MIN_OFFLOADED`` such tests, under ``--collect-only``, or with MPK_TEST_OFFLOAD=0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

NVCC_SKIP_REASON = "nvcc not on PATH"  # the `needs_nvcc` marks' reason starts so
OFFLOAD_ENV = "MPK_TEST_OFFLOAD"  # "0": everything in this process
WORKER_ENV = "MPK_TEST_OFFLOAD_WORKER"  # set in the child: it offloads nothing itself
MIN_OFFLOADED = 2  # below this a second interpreter's start-up (torch import) is not worth it
WORKER_TIMEOUT_S = 3600  # the child's whole run; past it the child is killed and the session fails

_worker: dict = {}  # the running child: proc, log path, basetemp, count, started


def is_nvcc_build(item) -> bool:
    """True for a test carrying the `needs_nvcc` skip mark."""
    return any(m.name == "skipif" and str(m.kwargs.get("reason", "")).startswith(NVCC_SKIP_REASON)
               for m in item.iter_markers())


def _offload_wanted(config, items) -> bool:
    if os.environ.get(WORKER_ENV) or os.environ.get(OFFLOAD_ENV, "1") == "0" or config.option.collectonly:
        return False
    if shutil.which("nvcc") is None:
        return False
    return not any(item.get_closest_marker("gpu") or item.get_closest_marker("multigpu") for item in items)


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what this session will not run (the gpu tests, in CI)
def pytest_collection_modifyitems(session, config, items):
    """Move the nvcc build tests to a child pytest process started now."""
    if not _offload_wanted(config, items):
        return
    moved = [item for item in items if is_nvcc_build(item)]
    if len(moved) < MIN_OFFLOADED:
        return
    basetemp = tempfile.mkdtemp(prefix="mpk-nvcc-tests-")
    log_path = os.path.join(basetemp, "pytest.log")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}/t",
           "-m", config.option.markexpr or "", *[item.nodeid for item in moved]]
    with open(log_path, "w") as log:
        # its own process group: killing it (timeout, Ctrl-C) takes its nvcc processes along
        proc = subprocess.Popen(cmd, cwd=str(config.rootpath), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, WORKER_ENV: "1"}, start_new_session=True)
    _worker.update(proc=proc, log=log_path, basetemp=basetemp, count=len(moved), started=time.monotonic())
    keep = set(moved)
    items[:] = [item for item in items if item not in keep]
    config.hook.pytest_deselected(items=moved)


def _kill(proc) -> None:
    """The child and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
    proc.wait()


def _wait_worker() -> tuple[int, str]:
    """(the child's exit code, its output); kills it past WORKER_TIMEOUT_S (exit code -9 then)."""
    proc = _worker["proc"]
    try:
        rc = proc.wait(timeout=max(1.0, WORKER_TIMEOUT_S - (time.monotonic() - _worker["started"])))
    except subprocess.TimeoutExpired:
        _kill(proc)
        rc = -9
    with open(_worker["log"], errors="replace") as f:
        out = f.read()
    if rc == -9:
        out += (f"\nnvcc_offload: the child pytest process ran past {WORKER_TIMEOUT_S} s and was killed "
                f"(its {_worker['count']} tests: {_worker['log']} shows how far it got)\n")
    return rc, out


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Wait for the child; its failure fails the session."""
    if "proc" not in _worker or "rc" in _worker:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED:  # Ctrl-C: do not wait for the child's builds
        _kill(_worker["proc"])
    rc, out = _wait_worker()
    _worker.update(rc=rc, out=out, seconds=time.monotonic() - _worker["started"])
    # 5 = no tests collected: every offloaded test deselected again in the child (never expected), not a failure
    if rc not in (0, 5) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if rc in (0, 5):  # a failed child's log stays for reading
        shutil.rmtree(_worker["basetemp"], ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The child's result: its summary line, or its whole output when it failed."""
    if "rc" not in _worker:
        return
    rc, out = _worker["rc"], _worker["out"]
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "(no output)"
    tr = terminalreporter
    tr.write_sep("-", f"{_worker['count']} nvcc build tests in a second process ({_worker['seconds']:.0f} s)")
    if rc in (0, 5):
        tr.write_line(last)
    else:
        tr.write_line(out.rstrip())
        tr.write_line(f"nvcc_offload: the child pytest process failed (exit code {rc}); its output is above "
                      f"(kept in {_worker['log']}). MPK_TEST_OFFLOAD=0 runs these tests in this process.")
