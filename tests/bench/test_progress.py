"""Progress wrapper: every backend yields every item, in order."""

import pytest

from mpk_dist.bench.progress import track


@pytest.mark.parametrize("backend", ["rich", "tqdm", "plain"])
def test_backends_yield_all_items(backend, capsys):
    assert list(track(range(7), description="x", backend=backend)) == list(range(7))
    assert capsys.readouterr().out == ""  # progress goes to stderr only


def test_disabled_is_plain_iteration():
    assert list(track([3, 1, 2], enabled=False)) == [3, 1, 2]
