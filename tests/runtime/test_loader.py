"""CPU tests of mpk_dist.runtime.loader's launch settings that need no GPU: the preferred shared-memory
carveout for MPK_MIN_CARVEOUT."""

from __future__ import annotations

import pytest

from mpk_dist.runtime.loader import BLOCK_RESERVED_SHARED_BYTES, SM_MAX_SHARED_BYTES, carveout_percent
from mpk_dist.runtime.megakernel_backend import tuning_from_env


@pytest.mark.parametrize("block", [0, 1, 17152 + 2304, 34304 + 2304, 100 * 1024, 227 * 1024])
def test_carveout_is_the_smallest_percentage_that_holds_the_block(block):
    pct = carveout_percent(block)
    need = block + BLOCK_RESERVED_SHARED_BYTES
    assert 0 <= pct <= 100
    assert pct * SM_MAX_SHARED_BYTES >= 100 * need or pct == 100, f"{pct}% does not hold {need} bytes"
    assert pct == 0 or (pct - 1) * SM_MAX_SHARED_BYTES < 100 * need, f"{pct - 1}% would already hold {need} bytes"


def test_min_carveout_switch_is_read_from_the_environment():
    assert tuning_from_env(512, {"MPK_MIN_CARVEOUT": "1"})["min_carveout"] is True
    assert "min_carveout" not in tuning_from_env(512, {})  # the default leaves the dict as it was
