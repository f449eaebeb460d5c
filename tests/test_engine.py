"""mpk_dist.engine: the KV-cache length a run sizes from its context."""

from __future__ import annotations

import pytest

from mpk_dist.engine import SEQ_LEN_ALIGN, context_max_seq_len
from mpk_dist.errors import InputError


@pytest.mark.parametrize("prompt, new, limit, want", [
    (3, 5, 40960, SEQ_LEN_ALIGN),           # short: one aligned block
    (480, 64, 40960, 576),                   # the issue-6 context: 544 rounded up
    (60, 4, 40960, 64),                      # exactly a multiple: not rounded further
    (100, 20, 100 + 20 + 3, 123),            # the rounding never passes the model's limit
])
def test_context_max_seq_len_fits_the_context(prompt, new, limit, want):
    got = context_max_seq_len(prompt, new, limit)
    assert got == want and prompt + new <= got <= limit


def test_context_max_seq_len_names_the_model_limit():
    with pytest.raises(InputError, match="expected at most the model's max_position_embeddings=128"):
        context_max_seq_len(100, 29, 128)
    with pytest.raises(InputError, match="--max-new-tokens: expected >= 1"):
        context_max_seq_len(10, 0, 128)
