"""Token bytes (OpenAI logprobs' ``bytes``) and completions' ``text_offset`` on small in-memory tokenizers of
both byte schemes: byte-level BPE (GPT-2 / SmolLM2) and SentencePiece-style byte fallback (Gemma)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from treedraft.logprobs import TokenLogprob
from treedraft.server.app import _TextOffsets
from treedraft.text import StreamDetokenizer
from treedraft.tokenizer import Tokenizer, byte_level_alphabet

CORPUS = ["héllo wörld — 日本語 🙂 naïve café", "plain ascii text here", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ünïcödé"] * 20
TEXT = st.text(alphabet=st.sampled_from("ab éü—日本語🙂𝔘\n"), min_size=1, max_size=24)


@functools.cache
def byte_level() -> Tokenizer:
    """A byte-level BPE trained on CORPUS (every byte has a token; merges join some characters' bytes)."""
    b = Backend(models.BPE())
    b.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    b.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    b.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, special_tokens=["<eos>"])
    )
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=b, eos_token="<eos>"))


@functools.cache
def byte_fallback() -> Tokenizer:
    """SentencePiece-style: a few pieces ('▁' for a space), every other byte as <0xNN>, Gemma's decoder chain."""
    vocab = {"<unk>": 0, "<eos>": 1} | {f"<0x{b:02X}>": 2 + b for b in range(256)}
    for piece in "▁abé日":
        vocab[piece] = len(vocab)
    b = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    b.normalizer = normalizers.Replace(" ", "▁")
    b.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=b, eos_token="<eos>", unk_token="<unk>"))


def test_byte_level_alphabet_is_a_bijection_onto_bytes() -> None:
    t = byte_level_alphabet()
    assert len(t) == 256 and sorted(t.values()) == list(range(256))
    assert (t["a"], t["Ġ"], t["Ċ"], t["Ã"]) == (ord("a"), 32, 10, 0xC3)


@pytest.mark.parametrize("make", [byte_level, byte_fallback], ids=["byte-level", "byte-fallback"])
@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_token_bytes_join_to_the_texts_utf8(make, text: str) -> None:
    """Joining a text's tokens' bytes gives its UTF-8, also where a token holds part of a character (decoded
    alone such a token is U+FFFD, whose bytes the old report gave)."""
    tok = make()
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@pytest.mark.parametrize("make", [byte_level, byte_fallback], ids=["byte-level", "byte-fallback"])
def test_split_characters_have_their_own_bytes_and_specials_their_text(make) -> None:
    tok = make()
    ids = tok.encode("🙂")
    assert len(ids) > 1  # the emoji is split: each piece decodes alone to U+FFFD
    assert all(tok.decode([i]) == "\ufffd" for i in ids)
    assert [len(tok.token_bytes(i)) for i in ids] != [3] * len(ids)
    assert tok.token_bytes(tok.hf.eos_token_id) == b"<eos>"


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_text_offsets_count_each_character_once(text: str) -> None:
    """Each token's offset is the number of whole characters before it: a character split over tokens counts
    once, and its pieces start where it starts."""
    tok = byte_level()
    ids = tok.encode(text)
    at = _TextOffsets(tok.token_bytes, frozenset()).take([TokenLogprob(i, -1.0) for i in ids])
    for k in range(len(ids)):
        before = b"".join(tok.token_bytes(i) for i in ids[:k]).decode("utf-8", errors="ignore")
        assert at[k] == len(before), (k, ids)
        assert text.startswith(before)


def test_text_offsets_leave_out_a_lead_and_generated_specials() -> None:
    tok = byte_level()
    eos = tok.hf.eos_token_id
    ids = [eos, *tok.encode("ab 日"), eos, *tok.encode("a")]
    lps = [TokenLogprob(i, -1.0) for i in ids]
    echo = _TextOffsets(tok.token_bytes, frozenset({eos})).take(lps, lead=1, generated=False)
    gen = _TextOffsets(tok.token_bytes, frozenset({eos})).take(lps)
    n = len(tok.encode("ab 日"))
    assert echo[0] == echo[1] == 0 and echo[n + 1] == 4 and echo[n + 2] == 4 + len("<eos>")  # the prompt's text
    assert gen[0] == 0 and gen[n + 1] == gen[n + 2] == 4  # generated: the EOS takes no room


@functools.cache
def dummy_prefix() -> Tokenizer:
    """SentencePiece as transformers builds Llama / Mistral tokenizers: a '▁' put before the text, and a decoder
    that strips one leading space again."""
    vocab = {"<unk>": 0, "<eos>": 1} | {f"<0x{b:02X}>": 2 + b for b in range(256)}
    for piece in ["▁", "a", "b", "é", "日", "▁ab", "▁a"]:
        vocab[piece] = len(vocab)
    b = Backend(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁a", "b")], byte_fallback=True, unk_token="<unk>"))
    b.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    b.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=b, eos_token="<eos>", unk_token="<unk>"))


@pytest.mark.parametrize("make", [byte_level, byte_fallback, dummy_prefix], ids=["byte-level", "fallback", "strip"])
@settings(max_examples=40, deadline=None)
@given(text=TEXT)
def test_generated_text_offsets_index_the_streamed_text(make, text: str) -> None:
    """Token k's offset is the length of the whole characters its predecessors make, and the streamed text
    (what a client receives) starts with exactly those characters: also where the decoder strips the first
    token's leading space (SentencePiece's dummy prefix), which token bytes alone would count."""
    tok = make()
    ids = tok.encode(text)
    stream = StreamDetokenizer(tok.backend)
    shown = "".join(stream.push(i) for i in ids) + stream.flush()
    at = _TextOffsets(tok.token_bytes, frozenset(), tok.leading_strip).take([TokenLogprob(i, -1.0) for i in ids])
    for k in range(len(ids)):
        before = b"".join(tok.token_bytes(i) for i in ids[:k]).decode("utf-8", errors="ignore")
        if k and tok.leading_strip and before.startswith(" "):
            before = before[1:]
        assert at[k] == len(before) and shown.startswith(before), (k, at, shown)
    assert tok.leading_strip == (1 if make is dummy_prefix else 0)


def test_a_model_directorys_generation_config_end_ids_end_answers(tmp_path) -> None:
    """A review (session 44): Gemma 3 IT's <end_of_turn> is an EOS only in generation_config.json; read from the
    tokenizer alone, an answer ran on into a made-up next turn."""
    import json

    tok = byte_level()
    tok.hf.save_pretrained(str(tmp_path))
    eos = tok.hf.eos_token_id
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {eos}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 7]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {eos, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {eos, 9}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {eos}  # unreadable: the tokenizer's own EOS still ends


def test_chat_messages_without_a_chat_template_say_to_send_one_string() -> None:
    with pytest.raises(ValueError, match="pass the text as one string with raw=True"):
        byte_level().apply_chat_template([{"role": "user", "content": "hi"}])
