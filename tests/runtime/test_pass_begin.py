"""The persistent-pass constants shared by csrc/runtime/pass_begin.cuh, watchdog.cuh and the host
(mpk_dist/runtime/params.py, pass_io.py) stay in step."""

from __future__ import annotations

import re
from pathlib import Path

from mpk_dist.runtime import params

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "runtime"


def _const(text: str, name: str) -> int:
    m = re.search(rf"constexpr (?:int|unsigned) {name} = (\d+);", text)
    assert m, f"{name} not found"
    return int(m.group(1))


def test_copy_table_and_doorbell_words_match_the_host():
    text = (CSRC / "pass_begin.cuh").read_text()
    assert _const(text, "kPassCopyCols") == params.PASS_COPY_COLS
    assert _const(text, "kDoorbellPosted") == params.DOORBELL_POSTED
    assert _const(text, "kDoorbellStop") == params.DOORBELL_STOP


def test_pass_wait_error_code_has_a_host_name():
    m = re.search(r"kErrPassWait = (\d+),", (CSRC / "watchdog.cuh").read_text())
    assert m and params.ERROR_CODES[int(m.group(1))] == "no pass posted"


def test_params_carry_the_channel_fields():
    names = [n for n, _ in params.PARAM_FIELDS]
    for f in ("pass_doorbell", "pass_stage", "pass_copies", "pass_wait_ns", "num_pass_copies"):
        assert f in names
        assert re.search(rf"\b{f};", (CSRC / "params.cuh").read_text()), f
