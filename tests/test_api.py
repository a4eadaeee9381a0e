"""Python API: drafters chosen by name use load()'s heads and are built once; unreadable GGUF files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import treedraft
from treedraft.api import LLM
from treedraft.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.engine import Engine
from treedraft.models.loaders import ModelLoadError
from treedraft.models.tiny import tiny_llama


def test_named_drafters_use_the_heads_given_to_load_and_are_built_once(tmp_path, monkeypatch) -> None:
    m = tiny_llama()
    MedusaHeads(MedusaConfig("tiny", m.hidden_size, m.vocab_size), m.lm_head.weight).save(tmp_path)
    llm = LLM(Engine(m), None, "tiny", "cpu", heads=str(tmp_path))  # no heads are shipped for "tiny"
    loads = []
    real_load = MedusaHeads.load
    monkeypatch.setattr(MedusaHeads, "load", staticmethod(lambda *a, **k: loads.append(a) or real_load(*a, **k)))
    d = llm.get_drafter("medusa")
    assert isinstance(d, MedusaDrafter) and llm.get_drafter("medusa") is d
    hybrid = llm.get_drafter("hybrid")
    assert llm.get_drafter("hybrid") is hybrid
    assert len(loads) == 2  # once for "medusa", once for "hybrid"; never again per call
    assert isinstance(llm.get_drafter("prompt-lookup"), PromptLookupDrafter)
    assert llm.get_drafter("none") is None
    assert llm.get_drafter("default") is llm.engine.drafter
    own = PromptLookupDrafter()
    assert llm.get_drafter(own) is own
    with pytest.raises(ValueError, match="unknown drafter"):
        llm.get_drafter("no-such-drafter")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"GGUF",
        b"GGUF" + struct.pack("<I", 3),
        b"GGUF" + struct.pack("<IQQ", 3, 10, 5) + struct.pack("<Q", 20) + b"general.",
        b"not a gguf file at all, just some text",
    ],
    ids=["empty", "magic-only", "no-counts", "cut-in-a-key", "not-gguf"],
)
def test_unreadable_gguf_raises_model_load_error_naming_the_file(tmp_path, content: bytes) -> None:
    p = tmp_path / "broken.gguf"
    p.write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf.*not a readable GGUF file"):
        treedraft.load(str(p), device="cpu")


def test_a_stop_given_as_one_string_is_one_stop_string() -> None:
    """stop="ab" is the stop string "ab" (as in OpenAI's API), not the stop strings "a" and "b" (tuple("ab")):
    the tiny model's answer is all "b", which "ab" never cuts but "b" would cut at once."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    llm = tiny_llm()
    full = llm.generate("abc abc", max_new_tokens=8, drafter=None)
    assert full.text == "b" * 8
    assert llm.generate("abc abc", max_new_tokens=8, drafter=None, stop="ab").text == full.text
    assert llm.generate("abc abc", max_new_tokens=8, drafter=None, stop=["b"]).text == ""


@pytest.mark.parametrize("bad", [0, 1, -5, True, 2.5])
def test_a_bad_max_seq_len_is_refused_before_loading(bad) -> None:
    with pytest.raises(ValueError, match="max_seq_len must be an integer >= 2"):
        treedraft.load(max_seq_len=bad)


def test_stop_token_ids_end_the_answer_like_eos() -> None:
    """vLLM's stop_token_ids: the id ends the answer ("stop"), is in token_ids but not in the text, also with
    ignore_eos; min_tokens holds it back; every drafter gives plain's tokens."""
    import dataclasses
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    llm = tiny_llm()  # its greedy answer to "abc abc" is all "b" (id 66)
    b = 66
    out = llm.generate("abc abc", max_new_tokens=8, drafter=None, stop_token_ids=[b])
    assert (out.text, out.token_ids, out.finish_reason) == ("", [b], "stop")
    held = llm.generate("abc abc", max_new_tokens=16, drafter=None, stop_token_ids=[b], min_tokens=3)
    assert b not in held.token_ids[:3] and len(held.token_ids) > 1
    assert held.finish_reason == "length" or held.token_ids.index(b) == len(held.token_ids) - 1  # ends at its b
    for d in ("prompt-lookup", "suffix"):
        assert llm.generate("abc abc", max_new_tokens=16, drafter=d, stop_token_ids=[b], min_tokens=3).token_ids == (
            held.token_ids
        )
    cfg = dataclasses.replace(llm.config(max_new_tokens=4, stop_token_ids=[b]), ignore_eos=True)
    kept = llm.text.generate(llm.encode_prompt("abc abc"), cfg, None)
    assert kept.token_ids == [b] and kept.finish_reason == "stop"  # ignore_eos leaves stop_token_ids on
    with pytest.raises(treedraft.GenerationError, match="outside this model's vocabulary"):
        llm.generate("abc", stop_token_ids=[96])


def test_chat_messages_are_read_as_the_server_reads_them() -> None:
    """The API takes what the OpenAI-compatible server takes: developer is a system message, content may be text
    parts, an assistant turn that called tools has null content, tool results become turns; anything else is a
    GenerationError saying what to change (an unknown role used to reach the template as it was)."""
    import os
    import sys

    from treedraft.interfaces import GenerationError

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import CharTokenizer, tiny_llm

    llm, tok = tiny_llm(), CharTokenizer()
    enc = llm.encode_prompt
    assert enc([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]) == enc(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    assert enc([{"role": "user", "content": parts}]) == enc([{"role": "user", "content": "hi"}])
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    turns = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tok.decode(enc(turns))
    # a free-text answer (no tools here): the call is told with its result; replayed as the assistant's JSON, SmolLM2
    # copied that JSON as its answer after the result (a review); with tools offered the JSON stays (the answer's form)
    assert text == '<user>weather?<user>weather was called with {"city": "Oslo"} and returned: sunny<assistant>'
    from treedraft.tools import parse_tools, render_messages

    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    auto = render_messages(turns, parse_tools([tool]), "auto")
    assert auto[2:] == [
        {"role": "assistant", "content": '{"weather": {"city": "Oslo"}}'},
        {"role": "user", "content": "Result of weather (call c1): sunny"},
    ]
    for bad, says in [
        ([{"role": "wizard", "content": "hi"}], "role must be one of system, developer, user, assistant, tool"),
        ([{"role": "user", "content": None}], "content is required"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
        (["hi"], "each message is a dict"),
        ([{"role": "user", "content": "x", "tool_calls": [call]}], "tool_calls belong to an assistant message"),
    ]:
        with pytest.raises(GenerationError, match=says):
            enc(bad)
        with pytest.raises(GenerationError, match=says):  # the tools path reads them the same way
            llm.generate(bad, tools=[{"type": "function", "function": {"name": "f"}}], max_new_tokens=2)
    with pytest.raises(GenerationError, match=r"stream\(\) takes no tools: use generate"):
        llm.stream("hi", tools=[{"type": "function", "function": {"name": "f"}}])


def test_two_threads_generating_on_one_llm_get_their_own_answers() -> None:
    """generate() from two threads at once: the second waits for the first's stream (they share the engine's one KV
    cache); each gets exactly its solo answer. Stepping both at once returned one request's tokens to the other."""
    import os
    import sys
    import threading

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    llm = tiny_llm()
    prompts = ["abc abc abc", "xyz xy xyz", "hello hello", "q r s q r s"]
    solo = {p: llm.generate(p, max_new_tokens=24).token_ids for p in prompts}
    for round_ in range(6):
        got: dict[str, object] = {}
        go = threading.Barrier(len(prompts))

        def run(p: str, go: threading.Barrier = go, got: dict = got) -> None:
            go.wait()
            try:
                got[p] = llm.generate(p, max_new_tokens=24).token_ids
            except Exception as e:  # recorded for the assert
                got[p] = e

        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == solo, round_


def test_load_argument_checks_before_the_load_and_a_readable_stats_repr(monkeypatch) -> None:
    """Bad threads / drafter / suffix_* values are refused with a message before the model is read; threads= sets
    the forwards' thread count; a GenerationStats prints as a summary, not its hundreds of steps."""
    from treedraft import api
    from treedraft.engine import GenerationStats, StepStats

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model was read before the bad argument"))
    for kw, says in [
        ({"threads": 0}, "threads must be an integer >= 1"),
        ({"drafter": 123}, "drafter must be a drafter name"),
        ({"suffix_max_tokens": "x"}, "suffix_max_tokens must be an integer"),
        ({"suffix_store": 123}, "suffix_store must be a directory path"),
        ({"suffix_share": "yes"}, "suffix_share must be True or False"),
    ]:
        with pytest.raises(ValueError, match=says):
            treedraft.load(**kw)
    seen = []
    monkeypatch.setattr("treedraft.cli.apply_threads", seen.append)
    monkeypatch.setattr(api, "load_model", lambda *a, **k: (_ for _ in ()).throw(ValueError("stop")))
    with pytest.raises(ValueError, match="stop"):
        treedraft.load(threads=3)
    assert seen == [3]
    st = GenerationStats(prompt_tokens=5, new_tokens=300, steps=[StepStats(3, 2, 1, 0.0, 0.0, 0.0)] * 150)
    assert len(repr(st)) < 250 and "steps=150" in repr(st) and "mean_accepted_length=2.00" in repr(st)


def test_a_stream_left_open_makes_another_thread_give_up_with_a_message(monkeypatch) -> None:
    """A stream started and left open (not finished, not closed) holds the LLM's turn: another thread's call waits,
    and gives up with a RuntimeError once the open stream has gone Engine.IDLE_WAIT_S without a step (it waited
    forever); once the stream is closed, the other thread runs."""
    import os
    import sys
    import threading

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    from treedraft.engine import Engine

    monkeypatch.setattr(Engine, "IDLE_WAIT_S", 0.5)
    llm = tiny_llm()
    open_stream = llm.stream("abc abc", max_new_tokens=20)
    next(open_stream)
    out: list = []

    def other() -> None:
        try:
            out.append(llm.generate("xyz xyz", max_new_tokens=4).token_ids)
        except RuntimeError as e:
            out.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert not t.is_alive() and isinstance(out[0], RuntimeError) and "without a step" in str(out[0])
    open_stream.close()
    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert out[1] == llm.generate("xyz xyz", max_new_tokens=4).token_ids


@pytest.mark.parametrize("bad", [None, 42, {"role": "user", "content": "hi"}])
def test_a_prompt_of_another_type_is_a_generation_error(bad) -> None:
    import os
    import sys

    from treedraft.interfaces import GenerationError

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    with pytest.raises(GenerationError, match="prompt must be a string or a list of chat messages"):
        tiny_llm().generate(bad)


def test_load_arguments_the_drafter_does_not_read_are_warned_about(tmp_path) -> None:
    """heads / suffix store settings given to a load whose drafter reads none of them warn, naming the drafters that
    do (they were accepted silently); a drafter that reads them, or plain decoding, says nothing; --kv-dtype on the
    hf runtime is refused before the load (it changed nothing there)."""
    import warnings

    from treedraft.api import warn_unread_args
    from treedraft.drafters.registry import HEADS_DRAFTERS, SUFFIX_DRAFTERS

    heads = str(Path(treedraft.__file__).parent / "heads" / "smollm2-135m-instruct")
    with pytest.warns(UserWarning) as got:
        llm = treedraft.load(drafter="prompt-lookup", heads=heads, suffix_share=True, suffix_store=str(tmp_path / "s"))
    llm.close()
    said = [str(w.message) for w in got]
    for flag in ("--heads", "--suffix-share", "--suffix-store"):
        assert any(m.startswith(flag) and "'prompt-lookup', which ignores it" in m for m in said), (flag, said)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in HEADS_DRAFTERS:
            warn_unread_args(["--heads / heads="], type("D", (), {"name": name})())
        for name in SUFFIX_DRAFTERS:
            warn_unread_args(["--suffix-store / suffix_store="], type("D", (), {"name": name})())
        warn_unread_args(["--heads / heads=", "--suffix-share / suffix_share="], None)
    with pytest.warns(UserWarning, match="'suffix', which ignores it"):
        warn_unread_args(["--heads / heads="], type("D", (), {"name": "suffix"})())
    with pytest.raises(ValueError, match="hf runtime keeps transformers' cache"):
        treedraft.load(runtime="hf", kv_dtype="float16", drafter=None)


def test_sampling_values_and_stop_strings_of_the_wrong_kind_are_clear_errors() -> None:
    """An infinite temperature divided every logit to nan and drew junk text without a word; a string temperature
    failed deep in a comparison, a fractional top_k was accepted, and ``stop=None`` (OpenAI's null: no stop strings)
    or ``stop=5`` raised a bare TypeError (a review)."""
    import os
    import sys

    from treedraft.interfaces import GenerationError

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    llm = tiny_llm()
    for kw, msg in [
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": "0.7"}, "temperature must be a number"),
        ({"top_p": None}, "top_p must be a number"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"top_k": True}, "top_k must be an integer"),
    ]:
        with pytest.raises(ValueError, match=msg):
            llm.generate("xyz", max_new_tokens=2, **kw)
    with pytest.raises(GenerationError, match="stop must be a string or a list of strings"):
        llm.generate("xyz", max_new_tokens=2, stop=5)
    assert llm.generate("xyz", max_new_tokens=4, stop=None).token_ids == llm.generate("xyz", max_new_tokens=4).token_ids
    assert (
        llm.config(top_k=np.int64(3)).sampling.top_k == 3
        and llm.config(temperature=np.float32(0.5)).sampling.temperature == 0.5
    )


def test_a_config_made_by_llm_config_is_taken_by_generate_and_stream_and_raw_needs_a_string() -> None:
    """``llm.config(...)`` builds a GenerationConfig that nothing public took: ``generate(p, config=cfg)`` failed with
    "LLM.config() got an unexpected keyword argument 'config'"; ``raw=True`` with chat messages was silently ignored
    (a review)."""
    import os
    import sys

    from treedraft.interfaces import GenerationError

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    llm = tiny_llm()
    cfg = llm.config(max_new_tokens=5, temperature=0.9, seed=3)
    want = llm.generate("xyz xyz", max_new_tokens=5, temperature=0.9, seed=3)
    assert llm.generate("xyz xyz", config=cfg).token_ids == want.token_ids and len(want.token_ids) == 5
    assert "".join(c.text for c in llm.stream("xyz xyz", config=cfg)) == want.text
    with pytest.raises(GenerationError, match="give config= or generation keywords \\(max_new_tokens\\), not both"):
        llm.generate("xyz", config=cfg, max_new_tokens=3)
    with pytest.raises(GenerationError, match="config must be a GenerationConfig"):
        llm.generate("xyz", config={"max_new_tokens": 3})
    with pytest.raises(GenerationError, match="raw=True takes a string prompt"):
        llm.generate([{"role": "user", "content": "hi"}], raw=True)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(GenerationError, match="raw=True takes no tools"):
        llm.generate("hi", raw=True, tools=[tool], tool_choice="auto")
    # any iterable of stop strings, as before (a set, a generator); a mapping or bytes is no list of strings
    assert (
        llm.generate("xyz", max_new_tokens=3, stop={"q"}).token_ids == llm.generate("xyz", max_new_tokens=3).token_ids
    )
    assert llm.config(stop=(s for s in ["a", "b"])).stop == ("a", "b")
    with pytest.raises(GenerationError, match="stop must be a string or a list of strings"):
        llm.config(stop={"a": 1})


def test_arguments_of_the_wrong_kind_are_clear_errors_not_tracebacks_or_coerced(monkeypatch) -> None:
    """A review (session 44): stop_token_ids "12" became (1, 2) and [2.9] (2,); load(drafter=<object>) passed its check
    and then failed after the model load; load(device=5), logit_bias=[...], max_tree_nodes="8" raised tracebacks."""
    import os
    import sys

    from treedraft import api
    from treedraft.interfaces import GenerationError

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    llm = tiny_llm()
    for kw, msg in [
        ({"stop_token_ids": "12"}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": [2.9]}, "stop_token_ids must be integer token ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be integer token ids"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"max_tree_nodes": "8"}, "max_tree_nodes must be an integer"),
        ({"max_tree_nodes": 2.5}, "max_tree_nodes must be an integer"),
    ]:
        with pytest.raises(GenerationError, match=msg):
            llm.config(**kw)
    assert llm.config(stop_token_ids=[np.int64(3)]).stop_token_ids == (3,)
    with pytest.raises(ValueError, match="drafter must be a drafter name"):
        llm.generate("xyz", max_new_tokens=2, drafter=5)
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model was read before the bad argument"))
    for kw, says in [({"device": 5}, "device must be a string"), ({"model": 5}, "model must be a name or path"),
                     ({"heads": 5}, "heads must be a name or path")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            treedraft.load(**kw)


def test_load_takes_a_drafter_object_as_its_default(monkeypatch) -> None:
    import os
    import sys

    from treedraft import api

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    small = tiny_llm()
    monkeypatch.setattr(api, "load_model", lambda *a, **k: (small.model, small.tokenizer, Path("tiny"), "cpu"))
    d = PromptLookupDrafter()
    llm = treedraft.load("tiny", drafter=d)  # (it failed after the load: unhashable type in the registry)
    assert llm.engine.drafter is d
    llm.close()
