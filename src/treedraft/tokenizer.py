"""Tokenizer wrapper: encode/decode, chat template; streaming detokenization is in :mod:`treedraft.text`."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path


class Tokenizer:
    """Thin wrapper around a transformers fast tokenizer with the bits the engine needs."""

    def __init__(
        self, hf_tokenizer, chat_template: str | None = None, eos_token_ids: Sequence[int] | None = None
    ) -> None:
        self.hf = hf_tokenizer
        self.chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None)
        eos = set(eos_token_ids or [])
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: Path | None = None) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (converted once, then cached as tokenizer.json)."""
        from transformers import AutoTokenizer

        path = Path(path)
        if cache_dir is not None and (cache_dir / "tokenizer.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(cache_dir))
        else:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            if cache_dir is not None:  # whole directory by a rename: a concurrent load never sees half of it
                from .models.cache import publish_dir, temp_sibling

                tmp = temp_sibling(cache_dir)
                shutil.rmtree(tmp, ignore_errors=True)
                tok.save_pretrained(str(tmp))
                publish_dir(tmp, cache_dir, "tokenizer.json")  # not published: converted again next time
        return cls(tok)

    @classmethod
    def from_dir(cls, d: str | Path) -> Tokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(d)))

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` behind the transformers tokenizer (used for streaming decode)."""
        return self.hf.backend_tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def is_chat(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, ending with the assistant's generation prompt."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass raw=True (CLI: --raw) for plain completion")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
        text = self.hf.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
        )
        return self.encode(text)
