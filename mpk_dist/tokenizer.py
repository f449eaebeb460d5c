"""Text <-> token ids: tokenizer.json through ``tokenizers`` when a checkpoint has one, else bytes.

Presets use a byte-level vocabulary: ids 0..255 are the bytes of UTF-8 text, larger ids (random
models produce them) decode to nothing.
"""

from __future__ import annotations

from pathlib import Path

from mpk_dist.errors import CheckpointError


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        """Ids of the UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of the ids that are bytes; other ids are dropped."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json loaded with the ``tokenizers`` library."""

    name = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise CheckpointError(f"{path}: unreadable tokenizer ({exc})") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self._tok.decode(ids)


def load_tokenizer(model_dir: Path | None):
    """tokenizer.json of ``model_dir`` if present, else the byte tokenizer."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(model_dir) / "tokenizer.json")
    return ByteTokenizer()
