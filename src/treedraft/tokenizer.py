"""Tokenizer wrapper: encode/decode, chat template; streaming detokenization is in :mod:`treedraft.text`."""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Sequence
from functools import cache, cached_property
from pathlib import Path

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def byte_level_alphabet() -> dict[str, int]:
    """The character that stands for each byte in a byte-level BPE vocabulary (GPT-2's reversible mapping, Radford
    et al. 2019): printable Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table = {chr(b): b for b in printable}
    for k, b in enumerate(b for b in range(256) if b not in printable):
        table[chr(0x100 + k)] = b
    return table


def generation_eos_ids(d: str | Path) -> list[int]:
    """The ``eos_token_id`` (an id or a list of ids) of ``d/generation_config.json``; [] without one (or when it
    cannot be read: the tokenizer's own EOS still ends answers)."""
    f = Path(d) / "generation_config.json"
    try:
        got = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
    except (OSError, ValueError, AttributeError):
        return []
    ids = got if isinstance(got, list) else [got]
    return [int(t) for t in ids if isinstance(t, int) and not isinstance(t, bool) and t >= 0]


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
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: Path | None = None) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (converted once, then cached as tokenizer.json)."""
        from transformers import AutoTokenizer

        path = Path(path)
        tok = None
        if cache_dir is not None and (cache_dir / "tokenizer.json").is_file():
            try:
                tok = AutoTokenizer.from_pretrained(str(cache_dir))
            except Exception as e:  # a torn or foreign cache entry: converted again, not a failed load
                print(
                    f"treedraft: the tokenizer cache {cache_dir} cannot be read ({type(e).__name__}); converting again",
                    file=sys.stderr,
                    flush=True,
                )
                shutil.rmtree(cache_dir, ignore_errors=True)
        if tok is None:
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
        """A Hugging Face model directory's tokenizer; its end-of-answer ids are the tokenizer's EOS and every
        ``eos_token_id`` of ``generation_config.json`` (an instruction model's end-of-turn, e.g. Gemma 3 IT's
        ``<end_of_turn>``, is often only there: without it an answer ran on into a made-up next turn)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(d)), eos_token_ids=generation_eos_ids(d))

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

    @property
    def leading_strip(self) -> int:
        """How many leading spaces the decoder drops from a text (a ``Strip`` step: SentencePiece's dummy prefix,
        as transformers builds Llama / Mistral tokenizers); 0 for byte-level and Gemma tokenizers."""
        steps = self._decoder_steps
        return sum(int(x.get("start", 0)) for x in steps if x.get("type") == "Strip" and x.get("content") == " ")

    @cached_property
    def _decoder_steps(self) -> list[dict]:
        """The backend decoder's steps (a Sequence's members, or the one decoder), from its JSON."""
        d = json.loads(self.backend.to_str()).get("decoder") or {}
        return d.get("decoders", []) if d.get("type") == "Sequence" else [d]

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, as OpenAI's logprobs ``bytes`` report them: the raw bytes a byte-level BPE token
        (GPT-2 / Llama 3 / SmolLM2 style) or a byte-fallback token (``<0xE6>``, SentencePiece style) stands for,
        even where they are part of a character, so that joining a reply's tokens' bytes gives its UTF-8 text.
        Decoding the token alone would give U+FFFD there. Added / special tokens: their text."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._token_bytes(int(token_id))
        return b

    @cached_property
    def added_tokens(self) -> dict[int, str]:
        """Added (special and control) tokens' ids and texts. Read once: transformers builds this map anew on every
        access (10 ms for Gemma's 6,384)."""
        return {t: str(getattr(a, "content", a)) for t, a in self._added.items()}

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens: chat markers, EOS, padding. Not text: Gemma's added whitespace
        tokens ("\n", runs of spaces) are added but not special."""
        return frozenset(t for t, a in self._added.items() if getattr(a, "special", True))

    @cached_property
    def _added(self) -> dict:
        return {int(t): a for t, a in (getattr(self.hf, "added_tokens_decoder", None) or {}).items()}

    @cached_property
    def _piece_rules(self) -> tuple[bool, bool, tuple[tuple[str, str], ...]]:
        """(byte-level, byte-fallback, the decoder's Replace steps) for :meth:`_token_bytes`."""
        steps = self._decoder_steps
        types = {x.get("type") for x in steps}
        replace = []
        for step in steps:  # e.g. Replace("▁", " "); Fuse / Strip act on whole texts
            pat = (step.get("pattern") or {}).get("String") if step.get("type") == "Replace" else None
            if pat is not None:
                replace.append((pat, step.get("content", "")))
        return "ByteLevel" in types, "ByteFallback" in types, tuple(replace)

    def _token_bytes(self, token_id: int) -> bytes:
        added = self.added_tokens.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self.hf.convert_ids_to_tokens(token_id)
        byte_level, fallback, replace = self._piece_rules
        if isinstance(piece, str) and byte_level:
            table = byte_level_alphabet()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if isinstance(piece, str) and fallback:
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            for pat, content in replace:
                piece = piece.replace(pat, content)
            return piece.encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, ending with the assistant's generation prompt."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template, so it cannot read chat messages: pass the text as one string with "
                "raw=True (CLI: --raw) for plain completion"
            )
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
        text = self.hf.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
        )
        return self.encode(text)
