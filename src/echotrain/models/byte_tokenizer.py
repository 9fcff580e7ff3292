"""A byte-level tokenizer: token id = UTF-8 byte (vocabulary 256), for tiny from-scratch policies.

It speaks the part of the Hugging Face tokenizer interface that echotrain's rollout, trainer and
evaluation use: ``tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)``
with ``padding_side`` (left for generation), ``pad_token_id`` / ``eos_token_id``, ``decode`` /
``batch_decode`` with ``skip_special_tokens``, ``save_pretrained``. Hugging Face's own
byte-level tokenizers remap bytes to printable characters and ids in merge order, so the ids
would not be the bytes; this class keeps id == byte, which the testbed's data relies on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text; EOS and padding are two byte values.

    Args:
        eos_token_id: the byte that ends a response (default 10, ``"\\n"``).
        pad_token_id: the byte used for padding (default 0, NUL); the attention mask marks it.
        padding_side: ``"left"`` (default, for batched generation) or ``"right"``.

    Raises:
        ValueError: ids outside [0, 256), equal EOS and pad ids, or a bad ``padding_side``.
    """

    vocab_size = 256

    def __init__(self, eos_token_id: int = 10, pad_token_id: int = 0, padding_side: str = "left"):
        for name, v in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
            if not (isinstance(v, int) and 0 <= v < 256):
                raise ValueError(f"{name} must be a byte value in [0, 256), got {v!r}")
        if eos_token_id == pad_token_id:
            raise ValueError("eos_token_id and pad_token_id must differ")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.eos_token_id, self.pad_token_id, self.padding_side = eos_token_id, pad_token_id, padding_side

    @property
    def eos_token(self) -> str:
        return chr(self.eos_token_id)

    @property
    def pad_token(self) -> str:
        return chr(self.pad_token_id)

    @property
    def all_special_ids(self) -> list[int]:
        return [self.pad_token_id, self.eos_token_id]

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` (``add_special_tokens`` appends EOS)."""
        ids = list(text.encode("utf-8"))
        return ids + [self.eos_token_id] if add_special_tokens else ids

    def __call__(self, texts: str | Sequence[str], return_tensors: str | None = "pt", padding: bool = True,
                 add_special_tokens: bool = False, **_: Any) -> dict[str, Any]:
        """Encode a batch: ``{"input_ids": (B, T) int64, "attention_mask": (B, T) int64}``, padded on
        ``padding_side`` to the longest text (lists of lists when ``return_tensors`` is None, flat
        lists for a single string, as Hugging Face tokenizers give).

        Raises:
            ValueError: ``return_tensors`` other than "pt"/None, or unequal lengths without padding.
        """
        batch = [texts] if isinstance(texts, str) else list(texts)
        ids = [self.encode(t, add_special_tokens) for t in batch]
        width = max((len(r) for r in ids), default=0)
        if not padding and len({len(r) for r in ids}) > 1:
            raise ValueError("texts have different lengths; pass padding=True")
        left = self.padding_side == "left"

        def pad(row: list[int], value: int) -> list[int]:
            fill = [value] * (width - len(row))
            return fill + row if left else row + fill

        input_ids = [pad(r, self.pad_token_id) for r in ids]
        mask = [pad([1] * len(r), 0) for r in ids]
        if return_tensors is None:  # like Hugging Face: one text gives flat lists, a batch nested ones
            if isinstance(texts, str):
                return {"input_ids": input_ids[0], "attention_mask": mask[0]}
            return {"input_ids": input_ids, "attention_mask": mask}
        if return_tensors != "pt":
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        return {"input_ids": torch.tensor(input_ids, dtype=torch.long).reshape(len(ids), width),
                "attention_mask": torch.tensor(mask, dtype=torch.long).reshape(len(ids), width)}

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        """Not supported: byte-level policies take plain-text prompts.

        Raises:
            ValueError: always, naming the fix (a task whose prompts are strings, e.g. ``task=testbed``).
        """
        raise ValueError("ByteTokenizer has no chat template: this policy takes plain-text prompts; use a task whose "
                         "prompts are strings (echotrain train: task=testbed with model=testbed; echotrain eval: --task "
                         "testbed, its default for --model testbed)")

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        """Bytes back to text (invalid UTF-8 replaced); ``skip_special_tokens`` drops EOS and pad bytes."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if skip_special_tokens:
            values = [v for v in values if v not in (self.eos_token_id, self.pad_token_id)]
        return bytes(int(v) for v in values).decode("utf-8", errors="replace")

    def batch_decode(self, rows: Sequence[Sequence[int]] | torch.Tensor, skip_special_tokens: bool = False) -> list[str]:
        """:meth:`decode` of each row."""
        return [self.decode(r, skip_special_tokens) for r in rows]

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``byte_tokenizer.json`` (the three settings) into ``directory``."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, "byte_tokenizer.json").write_text(json.dumps(
            {"eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id, "padding_side": self.padding_side}))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "ByteTokenizer":
        """Read what :meth:`save_pretrained` wrote."""
        return cls(**json.loads(Path(directory, "byte_tokenizer.json").read_text()))

    def __repr__(self) -> str:
        return f"ByteTokenizer(eos_token_id={self.eos_token_id}, pad_token_id={self.pad_token_id})"
