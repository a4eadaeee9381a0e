"""Live tests of the OpenAI-compatible server (`treedraft serve`) on 127.0.0.1.

One real model is loaded per module; uvicorn runs in a background thread on a free
port. The official `openai` client drives the happy paths, raw httpx the bad ones.
Every wait is bounded in time and every loop in count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import torch  # noqa: E402
from server_utils import LiveServer, scrape  # noqa: E402
from server_utils import assert_error as _assert_error  # noqa: E402
from server_utils import metric as _metric  # noqa: E402
from server_utils import wait_for as _wait_for  # noqa: E402

import treedraft  # noqa: E402
from treedraft.engine import GenerationConfig  # noqa: E402
from treedraft.server import Job, JobQueue, ServerSettings, create_app  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
CHAT = [{"role": "user", "content": "Name three colours."}]
COMPLETION_PROMPT = "The capital of France is"
REQUEST_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def llm(real_loader) -> Iterator[treedraft.LLM]:
    # The test process hosts the server, its worker and the clients on a small shared CPU:
    # one intra-op thread avoids oversubscription (several times faster here); restored afterwards.
    # Loaded before that, with the startup thread count: the session's cached measurements are for it.
    model = real_loader(drafter="prompt-lookup")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield model
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(llm: treedraft.LLM) -> dict[str, treedraft.GenerationResult]:
    """Greedy answers computed directly with the engine, before any server runs."""
    return {
        "chat": llm.generate(CHAT, max_new_tokens=MAX_TOKENS, drafter=None),
        "completion": llm.generate(COMPLETION_PROMPT, raw=True, max_new_tokens=MAX_TOKENS, drafter=None),
    }


@pytest.fixture(scope="module")
def server(llm: treedraft.LLM, reference: dict) -> Iterator[LiveServer]:
    with LiveServer(create_app(llm, ServerSettings(max_queue=32, poll_interval_s=0.05))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)


def _metrics(url: str) -> dict[tuple[str, frozenset], float]:
    return scrape(url)


# ----------------------------------------------------------------------------- pieces, no model needed


def test_job_queue_is_bounded_fifo_with_removal() -> None:
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job([1], GenerationConfig(max_new_tokens=1), "none", loop) for _ in range(4)]
        q = JobQueue(3)
        assert all(q.put_nowait(j) for j in jobs[:3])
        assert not q.put_nowait(jobs[3]), "a full queue must refuse"
        assert jobs[1].cancel() and len(q) == 2  # a waiting job that is cancelled leaves at once
        assert not jobs[1].cancel()
        assert q.put_nowait(jobs[3])
        assert [q.get() for _ in range(3)] == [jobs[0], jobs[2], jobs[3]]
        assert not jobs[0].cancel(), "a dequeued job is the worker's to stop"
        q.close()
        assert q.get() is None and not q.put_nowait(jobs[1])
    finally:
        loop.close()


# test_metrics_record_and_render lives in test_serving.py (no model needed).


# ----------------------------------------------------------------------------- happy paths (openai client)


def test_models_and_health(server: LiveServer, client: openai.OpenAI, llm: treedraft.LLM) -> None:
    import time

    models = client.models.list().data
    assert [m.id for m in models] == [llm.model_name]
    assert 0 < time.time() - models[0].created < 3600  # when the server loaded its model (was 0)
    r = httpx.get(f"{server.url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_chat_non_stream_matches_engine(client: openai.OpenAI, llm: treedraft.LLM, reference: dict) -> None:
    r = client.chat.completions.create(model=llm.model_name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    ref = reference["chat"]
    assert r.object == "chat.completion" and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(llm.encode_prompt(CHAT))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_logprobs_through_the_openai_client(client: openai.OpenAI, llm: treedraft.LLM) -> None:
    """The official client parses the logprobs; they equal the engine's own plain-decoding values for the same
    tokens (the server decodes with prompt lookup: speculative rows report plain's values)."""
    r = client.chat.completions.create(
        model=llm.model_name, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    ref = llm.generate(CHAT, max_new_tokens=12, drafter=None, logprobs=2)
    eos = llm.tokenizer.eos_token_ids
    want = [x for x in ref.logprobs if x.token_id not in eos]
    assert [c.token for c in content] == [llm.tokenizer.decode([x.token_id], skip_special_tokens=False) for x in want]
    assert [c.logprob for c in content] == [x.logprob for x in want]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)


def test_logprobs_bytes_and_offsets_follow_characters_split_over_tokens(
    client: openai.OpenAI, llm: treedraft.LLM
) -> None:
    """SmolLM2 splits CJK characters and emoji into byte-level pieces, each U+FFFD when decoded alone. Chat's
    ``bytes`` are the pieces' own bytes, so together they spell the answer; the completions' ``text_offset`` of an
    echoed prompt points into the returned text (a split character counted once)."""
    msgs = [{"role": "user", "content": "Repeat exactly: 日本語 🙂 café"}]
    r = client.chat.completions.create(model=llm.model_name, messages=msgs, max_tokens=16, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert any(c.token == "\ufffd" for c in content), "the prompt no longer makes split characters"
    # (an answer cut by max_tokens inside a character ends in U+FFFD, as its bytes decode)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace") == r.choices[0].message.content
    prompt = "日本語のテキスト 🙂 and more"
    c = client.completions.create(
        model=llm.model_name, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0
    )
    lp, text = c.choices[0].logprobs, c.choices[0].text
    ids = llm.encode_prompt(prompt, raw=True)
    assert text.startswith(prompt) and len(ids) > len(prompt.split())
    for k, tok in enumerate(lp.tokens[: len(ids)]):
        whole = b"".join(llm.tokenizer.token_bytes(i) for i in ids[:k]).decode("utf-8", errors="ignore")
        assert lp.text_offset[k] == len(whole) and prompt.startswith(whole), k
        if "\ufffd" not in tok:
            assert text[lp.text_offset[k] :].startswith(tok), k
    assert lp.text_offset[len(ids)] == len(prompt)  # the answer's first token starts right after the prompt


def test_chat_stream_with_usage(client: openai.OpenAI, llm: treedraft.LLM, reference: dict) -> None:
    stream = client.chat.completions.create(
        model=llm.model_name,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finishes, usages, roles = [], [], [], []
    for i, ch in enumerate(stream):
        assert i < 500, "unbounded stream"
        assert ch.object == "chat.completion.chunk"
        if ch.usage is not None:
            usages.append(ch.usage)
            assert ch.choices == []
            continue
        d = ch.choices[0].delta
        roles += [d.role] if d.role else []
        parts.append(d.content or "")
        if ch.choices[0].finish_reason:
            finishes.append(ch.choices[0].finish_reason)
    ref = reference["chat"]
    assert roles == ["assistant"]
    assert "".join(parts) == ref.text
    assert finishes == [ref.finish_reason]
    assert len(usages) == 1 and usages[0].completion_tokens == len(ref.token_ids)
    assert usages[0].prompt_tokens == len(llm.encode_prompt(CHAT))


def test_stream_raw_sse_ends_with_done(server: LiveServer, llm: treedraft.LLM) -> None:
    body = {"model": llm.model_name, "prompt": COMPLETION_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    lines = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            lines.append(line)
            assert len(lines) < 200
    data = [ln for ln in lines if ln]
    assert all(ln.startswith("data: ") for ln in data), data
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in json.loads(ln[6:]) for ln in data[:-1])  # not asked for


def test_completions_stream_and_not(client: openai.OpenAI, llm: treedraft.LLM, reference: dict) -> None:
    ref = reference["completion"]
    r = client.completions.create(model=llm.model_name, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(llm.encode_prompt(COMPLETION_PROMPT, raw=True))
    parts, usage = [], None
    stream = client.completions.create(
        model=llm.model_name,
        prompt=COMPLETION_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for i, ch in enumerate(stream):
        assert i < 500
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            parts.append(c.text)
    assert "".join(parts) == ref.text
    assert usage is not None and usage.completion_tokens == len(ref.token_ids)
    # token-id prompts work too and give the same answer
    ids = llm.encode_prompt(COMPLETION_PROMPT, raw=True)
    r2 = client.completions.create(model=llm.model_name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r2.choices[0].text == ref.text


def test_stop_string(client: openai.OpenAI, llm: treedraft.LLM, reference: dict) -> None:
    ref = reference["completion"].text
    words = [w for w in ref.split() if len(w) > 2 and ref.index(w) > 0]
    assert words, f"reference too short to pick a stop word: {ref!r}"
    stop = words[0]
    for s in (stop, [stop, "zzzz-never"]):
        r = client.completions.create(
            model=llm.model_name, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=s
        )
        assert r.choices[0].text == ref[: ref.index(stop)]
        assert r.choices[0].finish_reason == "stop"


def test_extension_drafters_agree_and_sampling_seed(client: openai.OpenAI, llm: treedraft.LLM, reference: dict) -> None:
    texts = {}
    for name in ("none", "prompt-lookup", "default"):
        r = client.chat.completions.create(
            model=llm.model_name,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"treedraft": {"drafter": name, "max_tree_nodes": 8}},
        )
        texts[name] = r.choices[0].message.content
        assert r.model_extra["treedraft"]["drafter"] == ("prompt-lookup" if name == "default" else name)
    assert set(texts.values()) == {reference["chat"].text}, texts
    # sampling with a seed is reproducible, with either acceptance rule
    for rule in ("speculative", "typical"):
        outs = {
            client.chat.completions.create(
                model=llm.model_name,
                messages=CHAT,
                max_tokens=6,
                temperature=0.9,
                top_p=0.95,
                seed=1234,
                extra_body={"treedraft": {"rule": rule}},
            )
            .choices[0]
            .message.content
            for _ in range(2)
        }
        assert len(outs) == 1, (rule, outs)


def test_nulls_mean_defaults_and_drafter_names_pass_through(server: LiveServer, llm: treedraft.LLM) -> None:
    body = {
        "model": llm.model_name,
        "messages": CHAT,
        "max_tokens": 2,
        "temperature": None,
        "top_p": None,
        "n": None,
        "stop": None,
        "seed": None,
        "stream": None,
        "user": "someone",
        "unknown_field": 1,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    # every registered drafter name is passed through: it either serves or is a clean 400 (e.g. no heads shipped)
    from treedraft.drafters import names

    for name in names():
        body = {
            "model": llm.model_name,
            "messages": CHAT,
            "max_tokens": 2,
            "temperature": 0,
            "treedraft": {"drafter": name},
        }
        for stream in (False, True):
            r = httpx.post(
                f"{server.url}/v1/chat/completions", json={**body, "stream": stream}, timeout=REQUEST_TIMEOUT
            )
            if r.status_code != 200:
                _assert_error(r, 400, "treedraft.drafter")


# ----------------------------------------------------------------------------- bad input (raw httpx)
# The parametrized bad-input battery runs on the tiny model in test_serving.py (same server code, fast).


def test_unknown_model_routes_and_methods(server: LiveServer) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=30,
        json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
    )
    err = _assert_error(r, 404, "model")
    assert err["code"] == "model_not_found" and "gpt-17" in err["message"]
    _assert_error(httpx.get(f"{server.url}/v1/nothing-here", timeout=10), 404)
    _assert_error(httpx.get(f"{server.url}/v1/chat/completions", timeout=10), 405)
    # and the server is still alive and serving
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_openai_client_sees_errors(client: openai.OpenAI, llm: treedraft.LLM) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=llm.model_name, messages=CHAT, max_tokens=2, n=17)
    assert ei.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=llm.model_name,
            messages=CHAT,
            max_tokens=2,
            stream=True,
            extra_body={"treedraft": {"drafter": "nope"}},
        )


class _BrokenDrafter:
    """A drafter with a bug: its propose raises ``exc``."""

    def __init__(self, name: str, exc: Exception) -> None:
        self.name, self.exc = name, exc

    def propose(self, ctx: object) -> None:
        raise self.exc


def test_internal_errors_are_500_logged_and_the_server_keeps_serving(
    llm: treedraft.LLM, reference: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug during generation (here broken drafters; a ValueError too, like a cache overflow or an
    inconsistent q) is the server's fault: 500 + OpenAI error body + a logged traceback, never a 400;
    the worker survives and the next request is served normally."""
    from treedraft.drafters import registry
    from treedraft.tree import TreeError

    broken = {
        "medusa": RuntimeError("boom: a drafter bug"),
        "hybrid": ValueError("draft token 7 has zero draft probability; the drafter's q is inconsistent"),
        "prompt-lookup": TreeError("parents must come before their children"),
    }
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the registrations below are undone
    for name in broken:
        registry.register(
            name, lambda target, tok, opts, name=name: _BrokenDrafter(name, broken[name]), "broken", replace=True
        )
    # a fresh drafter cache: drafters the shared fixture built earlier must not be reused
    monkeypatch.setattr(llm, "drafters", registry.DrafterCache(llm.model, llm.tokenizer, llm.drafters.options))
    body = {"model": llm.model_name, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    app = create_app(llm, ServerSettings(poll_interval_s=0.05))
    with caplog.at_level(logging.ERROR, logger="treedraft.server"), LiveServer(app) as s:
        url = f"{s.url}/v1/chat/completions"
        for name, exc in broken.items():
            r = httpx.post(url, json={**body, "treedraft": {"drafter": name}}, timeout=REQUEST_TIMEOUT)
            err = _assert_error(r, 500, None)
            assert err["type"] == "server_error" and str(exc) in err["message"], err
        # streamed: the first token went out before the failure, so the error arrives in-band, then [DONE]
        r = httpx.post(url, json={**body, "stream": True, "treedraft": {"drafter": "hybrid"}}, timeout=REQUEST_TIMEOUT)
        assert r.status_code == 200, r.text
        events = [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        errors = [e["error"] for e in map(json.loads, events[:-1]) if "error" in e]
        assert len(errors) == 1 and errors[0]["type"] == "server_error"
        assert str(broken["hybrid"]) in errors[0]["message"]
        # still alive: the same request with a working drafter gets the right answer
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
        for name in ("none", "default"):
            r = httpx.post(url, json={**body, "treedraft": {"drafter": name}}, timeout=REQUEST_TIMEOUT)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == reference["chat"].text
        m = _metrics(s.url)
        assert _metric(m, "treedraft:request_errors_total", status="500") == 4
        assert _metric(m, "treedraft:request_errors_total", status="400") == 0
    logged = [rec for rec in caplog.records if rec.name == "treedraft.server" and rec.levelno >= logging.ERROR]
    assert len(logged) == 4 and all(rec.exc_info for rec in logged)
    assert {type(rec.exc_info[1]) for rec in logged} == {RuntimeError, ValueError, TreeError}


# ----------------------------------------------------------------------------- metrics


def test_metrics_move_after_requests(server: LiveServer, client: openai.OpenAI, llm: treedraft.LLM) -> None:
    before = _metrics(server.url)
    for name in (
        "treedraft:num_requests_running",
        "treedraft:num_requests_waiting",
        "treedraft:spec_decode_num_drafts_total",
        "treedraft:time_to_first_token_seconds_count",
    ):
        assert (name, frozenset()) in before, name
    msgs = [{"role": "user", "content": "Repeat exactly: red green blue, red green blue, red green blue."}]
    r = client.chat.completions.create(
        model=llm.model_name,
        messages=msgs,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"treedraft": {"drafter": "prompt-lookup"}},
    )
    httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, timeout=10)
    after = _metrics(server.url)

    def delta(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("treedraft:num_requests_total") == 1
    assert delta("treedraft:request_success_total", finished_reason=r.choices[0].finish_reason) == 1
    assert delta("treedraft:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("treedraft:generation_tokens_total") == r.usage.completion_tokens
    assert delta("treedraft:time_to_first_token_seconds_count") == 1
    assert delta("treedraft:e2e_request_latency_seconds_count") == 1
    assert delta("treedraft:time_to_first_token_seconds_bucket", le="+Inf") == 1
    assert delta("treedraft:request_errors_total", status="400") >= 1
    info = r.model_extra["treedraft"]
    steps = delta("treedraft:spec_decode_num_verify_steps_total")
    drafts = delta("treedraft:spec_decode_num_drafts_total")
    assert steps == info["steps"] and steps >= 1
    assert 1 <= drafts <= steps, "prompt lookup should have drafted on a repetitive prompt"
    accepted = delta("treedraft:spec_decode_num_accepted_tokens_total")
    assert accepted == info["accepted_tokens"]
    assert delta("treedraft:spec_decode_num_draft_tokens_total") == info["drafted_tokens"] >= accepted
    per_pos = sum(
        v - _metric(before, k[0], **dict(k[1]))
        for k, v in after.items()
        if k[0] == "treedraft:spec_decode_num_accepted_tokens_per_pos_total"
    )
    assert per_pos == accepted
    assert delta("treedraft:spec_decode_num_drafts_per_pos_total", position="0") == drafts
    # committed tokens = accepted drafts + one target token per step (+ the root from prefill)
    assert accepted + steps + 1 >= r.usage.completion_tokens
    assert _metric(after, "treedraft:generation_tokens_per_second") > 0
    assert _metric(after, "treedraft:num_requests_running") == 0


# ----------------------------------------------------------------------------- queue, disconnects


def test_queue_full_429_and_disconnects_free_the_worker(llm: treedraft.LLM, server: LiveServer) -> None:
    """One request at a time (--max-batch 1), a tiny queue behind a long stream: a queued client that leaves frees its place, a full queue
    answers 429 + Retry-After, and closing the long stream lets the queued request finish."""
    settings = ServerSettings(max_queue=1, max_batch=1, retry_after_s=7, poll_interval_s=0.05)  # serial worker
    with LiveServer(create_app(llm, settings)) as s:
        url = f"{s.url}/v1/chat/completions"
        # long enough to outlast the steps below even on a fast accelerator; it is cancelled, never finished
        long_body = {
            "model": llm.model_name,
            "messages": CHAT,
            "max_tokens": 4000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "treedraft": {"drafter": "none"},
        }
        short_body = {"model": llm.model_name, "messages": CHAT, "max_tokens": 3, "temperature": 0}
        before = _metrics(s.url)
        with httpx.Client(timeout=REQUEST_TIMEOUT) as c, c.stream("POST", url, json=long_body) as stream_a:
            assert stream_a.status_code == 200
            lines = stream_a.iter_lines()
            for _ in range(50):  # read until the first content arrives: A now owns the worker
                line = next(lines)
                if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                    break
            else:
                pytest.fail("no content from the long stream")
            assert _metric(_metrics(s.url), "treedraft:num_requests_running") == 1
            t = time.perf_counter()  # the event loop answers while the worker is busy
            assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
            assert time.perf_counter() - t < 2.0

            # D waits in the queue, then its client gives up: its place must be freed
            def waiting() -> float:
                return _metric(_metrics(s.url), "treedraft:num_requests_waiting")

            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, json=short_body, timeout=httpx.Timeout(10, read=1.5))
            _wait_for(lambda: waiting() == 0, "the abandoned queued request to leave the queue", 10)

            # B takes the only place in the queue ...
            result: dict = {}

            def run_b() -> None:
                with httpx.Client(timeout=REQUEST_TIMEOUT) as cb:
                    result["b"] = cb.post(url, json=short_body)

            tb = threading.Thread(target=run_b, daemon=True)
            tb.start()
            _wait_for(lambda: waiting() == 1, "B to be queued", 10)
            # ... so C is turned away at once
            r = httpx.post(url, json=short_body, timeout=10)
            err = _assert_error(r, (429, 503))
            assert r.headers.get("retry-after") == "7"
            assert err["code"] == "queue_full"
            assert tb.is_alive(), "B finished although A should still hold the worker"
        # leaving the `with` closed A's connection mid-stream: the worker must drop A and serve B
        tb.join(REQUEST_TIMEOUT)
        assert not tb.is_alive(), "B never finished: the disconnected stream still holds the worker"
        assert result["b"].status_code == 200, result["b"].text
        assert result["b"].json()["choices"][0]["message"]["content"]
        after = _metrics(s.url)
        aborted = _metric(after, "treedraft:request_aborted_total") - _metric(before, "treedraft:request_aborted_total")
        assert aborted == 2  # A (running) and D (waiting)
        gen = _metric(after, "treedraft:generation_tokens_total") - _metric(before, "treedraft:generation_tokens_total")
        assert gen < 4000, f"A ran to completion although its client left ({gen} tokens)"
        assert _metric(after, "treedraft:num_requests_running") == 0
        assert _metric(after, "treedraft:num_requests_waiting") == 0
        assert _metric(after, "treedraft:request_errors_total", status="429") == 1
        assert httpx.post(url, json=short_body, timeout=REQUEST_TIMEOUT).status_code == 200


def test_a_job_the_worker_took_holds_its_slot_before_the_worker_recounts() -> None:
    """The free slots were recounted only after the worker admitted the jobs it took (admitting can take a prompt
    forward): meanwhile the jobs it held still counted as free slots and the queue over-admitted (a review)."""
    q = JobQueue(0, free=2)
    jobs = [Job([1], GenerationConfig(), None, None) for _ in range(3)]
    assert q.put_nowait(jobs[0]) and q.put_nowait(jobs[1]) and not q.put_nowait(jobs[2])
    assert q.get_nowait() is jobs[0] and q.room() == 0  # taken: it holds a slot, nothing new fits
    assert not q.put_nowait(jobs[2])
    q.free = 1  # the worker's recount after a job left
    assert q.room() == 0 and q.get_nowait() is jobs[1] and q.room() == 0 and q.free == 0


def test_free_batch_slots_are_not_queue_places_and_a_refused_request_queues_nothing(llm: treedraft.LLM) -> None:
    """--max-queue counts requests waiting behind a FULL batch. A review saw an idle --max-batch 4 --max-queue 1 server
    answer 3 requests at once [200, 200, 429], --max-queue 0 refuse every request ("n=None is more jobs ..."), and an
    n=3 request refused with 429 count a phantom abort (its first choice had been queued, then cancelled)."""
    from concurrent.futures import ThreadPoolExecutor

    settings = ServerSettings(max_queue=0, max_batch=3, poll_interval_s=0.05)
    with LiveServer(create_app(llm, settings)) as s:
        url = f"{s.url}/v1/chat/completions"
        short_body = {"model": llm.model_name, "messages": CHAT, "max_tokens": 3, "temperature": 0}
        with ThreadPoolExecutor(3) as ex:  # three at once on an idle server: the free batch slots take them all
            codes = list(
                ex.map(lambda _: httpx.post(url, json=short_body, timeout=REQUEST_TIMEOUT).status_code, range(3))
            )
        assert codes == [200, 200, 200]
        r = httpx.post(url, json=short_body | {"n": 3}, timeout=REQUEST_TIMEOUT)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        r = httpx.post(url, json=short_body | {"n": 4}, timeout=REQUEST_TIMEOUT)
        assert _assert_error(r, 400) and "n=4 is more jobs than this server holds at once (3 running + 0" in r.text
        long_body = short_body | {
            "max_tokens": 4000,
            "stream": True,
            "ignore_eos": True,
            "treedraft": {"drafter": "none"},
        }
        with httpx.Client(timeout=REQUEST_TIMEOUT) as c, c.stream("POST", url, json=long_body) as stream_a:
            lines = stream_a.iter_lines()
            while '"content": "' not in next(lines).replace('"content": ""', ""):
                pass  # A holds one of the three slots
            before = _metrics(s.url)
            r = httpx.post(url, json=short_body | {"n": 3}, timeout=REQUEST_TIMEOUT)  # 2 free slots, no queue
            assert _assert_error(r, 429)["code"] == "queue_full"
            after = _metrics(s.url)
            for name in ("treedraft:request_aborted_total", "treedraft:num_requests_total"):
                assert _metric(after, name) == _metric(before, name), name  # nothing was queued, nothing aborted
            r = httpx.post(url, json=short_body | {"n": 2}, timeout=REQUEST_TIMEOUT)  # fits the two free slots
            assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_a_client_leaving_while_it_uploads_is_an_abort_not_a_server_error(llm: treedraft.LLM) -> None:
    """A client that closes its socket halfway through its body used to count as a 500 and log two tracebacks."""
    import socket
    from urllib.parse import urlparse

    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.05))) as s:
        u = urlparse(s.url)
        before = _metrics(s.url)
        for _ in range(2):
            with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 500\r\n\r\n" + b'{"messages": [{"role": "user", '
                )
                time.sleep(0.3)
        _wait_for(
            lambda: (
                _metric(_metrics(s.url), "treedraft:request_aborted_total")
                - _metric(before, "treedraft:request_aborted_total")
                == 2
            ),
            "the two dropped uploads to count as aborted",
            10,
        )
        after = _metrics(s.url)
        assert _metric(after, "treedraft:request_errors_total", status="500") == 0
        short_body = {"model": llm.model_name, "messages": CHAT, "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{s.url}/v1/chat/completions", json=short_body, timeout=REQUEST_TIMEOUT).status_code == 200


def test_a_request_body_that_stalls_is_answered_408_and_closed(llm: treedraft.LLM) -> None:
    """A client that sends its headers and a few bytes of body, then nothing, held its connection for as long as it
    liked (a soak review: 8 such connections open for a minute, nothing closed them). Past body_timeout_s: 408."""
    import socket
    from urllib.parse import urlparse

    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.05, body_timeout_s=0.5))) as s:
        u = urlparse(s.url)
        with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 500\r\n\r\n" + b'{"messages": [{"role": "user", '
            )
            t0 = time.perf_counter()
            got = b""
            while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
            waited = time.perf_counter() - t0
        assert got.startswith(b"HTTP/1.1 408") and b"request body stalled" in got, got[:200]
        assert 0.4 < waited < 5.0
        short_body = {"model": llm.model_name, "messages": CHAT, "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{s.url}/v1/chat/completions", json=short_body, timeout=REQUEST_TIMEOUT).status_code == 200
    with pytest.raises(ValueError, match="body_timeout_s must be > 0"):
        ServerSettings(body_timeout_s=0)


def test_every_choice_of_a_dropped_request_is_counted_once(llm: treedraft.LLM) -> None:
    """An n=3 request whose client leaves while choice 0 runs and choices 1-2 wait in the queue (--max-batch 1): 3
    jobs queued, 3 aborted (the queued two were dropped uncounted: request_aborted rose by 1), streamed or not."""
    settings = ServerSettings(max_queue=8, max_batch=1, poll_interval_s=0.05)
    with LiveServer(create_app(llm, settings)) as s:
        url = f"{s.url}/v1/chat/completions"
        body = {"model": llm.model_name, "messages": CHAT, "max_tokens": 4000, "temperature": 0, "n": 3,
                "ignore_eos": True, "treedraft": {"drafter": "none"}}  # fmt: skip

        def settled() -> bool:
            m = _metrics(s.url)
            return _metric(m, "treedraft:num_requests_running") == 0 == _metric(m, "treedraft:num_requests_waiting")

        for stream in (True, False):
            before = _metrics(s.url)
            if stream:
                with (
                    httpx.Client(timeout=REQUEST_TIMEOUT) as c,
                    c.stream("POST", url, json=body | {"stream": True}) as r,
                ):
                    lines = r.iter_lines()
                    while '"content": "' not in next(lines).replace('"content": ""', ""):
                        pass  # choice 0 is decoding
                    assert _metric(_metrics(s.url), "treedraft:num_requests_waiting") == 2
            else:
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(url, json=body, timeout=httpx.Timeout(10, read=1.5))
            _wait_for(settled, "the dropped request's jobs to leave", 20)
            after = _metrics(s.url)

            def delta(name: str, after: dict = after, before: dict = before) -> float:
                return _metric(after, name) - _metric(before, name)

            assert delta("treedraft:num_requests_total") == 3, stream
            assert delta("treedraft:request_aborted_total") == 3, stream
            assert delta("treedraft:generation_tokens_total") < 4000, stream


# ----------------------------------------------------------------------------- concurrency


def test_parallel_streams_equal_serial(server: LiveServer, llm: treedraft.LLM) -> None:
    """16 concurrent greedy streams (4 prompts x 2 drafters): each equals the same request served alone."""
    prompts = ["Name a fruit.", "What is 2+2?", "Say hi in French.", "Name a planet."]
    drafters = ["prompt-lookup", "none"]
    n_tokens = 8

    def body(i: int) -> dict:
        return dict(
            model=llm.model_name,
            messages=[{"role": "user", "content": prompts[i % 4]}],
            max_tokens=n_tokens,
            temperature=0,
            extra_body={"treedraft": {"drafter": drafters[i // 4 % 2]}},
        )

    async def one(cl: openai.AsyncOpenAI, i: int) -> str:
        parts = []
        stream = await cl.chat.completions.create(**body(i), stream=True)
        n = 0
        async for ch in stream:
            n += 1
            assert n < 200
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
        return "".join(parts)

    async def main() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT
        ) as cl:
            alone = [await one(cl, i) for i in range(8)]  # every distinct request, one at a time
            together = await asyncio.wait_for(asyncio.gather(*(one(cl, i) for i in range(16))), 300)
        return alone, together

    alone, together = asyncio.run(main())
    assert len(set(alone[:4])) == 4, alone  # different prompts -> different answers, so mixing would show
    for i, text in enumerate(together):
        assert text == alone[i % 8], (i, text, alone[i % 8])
    m = _metrics(server.url)
    assert _metric(m, "treedraft:num_requests_running") == 0 and _metric(m, "treedraft:num_requests_waiting") == 0


def test_a_drain_during_a_step_or_an_admission_answers_each_job_once() -> None:
    """Worker.fail_all runs on a timer's thread while the worker is busy. A job that finishes in the step it fires
    in keeps the 503 it was given (no Done after it; counted as a failure, not a success); a job being admitted when
    it fires (its drafter being built) is answered too (it was dropped unanswered: in neither the batch nor the
    queue)."""
    from types import SimpleNamespace

    from treedraft.engine import GenerationConfig
    from treedraft.server.metrics import Metrics
    from treedraft.server.protocol import APIError
    from treedraft.server.worker import Done, Failed, Job, Worker
    from treedraft.text import Chunk

    class Loop:  # items delivered at once, on the worker's thread
        def call_soon_threadsafe(self, fn, *a):
            fn(*a)

    class Sched:
        before_forward = None

        def __init__(self, in_step, release) -> None:
            self.in_step, self.release, self.reqs = in_step, release, []

        def add(self, ids, cfg, drafter, stats, tag=None, scope=""):
            self.reqs.append(SimpleNamespace(max_new=4, error=None, tag=tag))
            return self.reqs[-1]

        def step(self):
            self.in_step.set()
            assert self.release.wait(10)
            return [(r, [5]) for r in self.reqs]

        def remove(self, req) -> None:
            self.reqs.remove(req)

    class Text:  # every job ends with its first token
        done = False

        def feed(self, new):
            self.done = True
            return [Chunk("x", list(new), "stop", None)]

    err = APIError(503, "shutting down", code="server_shutting_down")
    for where in ("step", "admission"):
        in_step, release, building = threading.Event(), threading.Event(), threading.Event()

        def drafter(name, heads=None, building=building, release=release):
            building.set()
            assert release.wait(10)  # the drafter's first build, slow

        llm = SimpleNamespace(
            get_drafter=drafter if where == "admission" else (lambda name, heads=None: None),
            text=SimpleNamespace(text_stream=lambda c, m, s: Text()),
        )
        outcomes: list[str] = []
        metrics = Metrics("tiny")

        def record(*a, outcomes=outcomes, real=metrics.record, **k):
            outcomes.append(a[6])
            return real(*a, **k)

        metrics.record = record  # type: ignore[method-assign]
        w = Worker(llm, ServerSettings(), metrics)  # type: ignore[arg-type]
        w._scheduler = lambda in_step=in_step, release=release: Sched(in_step, release)  # type: ignore[method-assign]
        job = Job([1, 2, 3], GenerationConfig(), "none", Loop())  # type: ignore[arg-type]
        w.start()
        try:
            w.queue.put_nowait(job)
            assert (in_step if where == "step" else building).wait(10)
            w.fail_all(err)
            release.set()
            deadline = time.monotonic() + 10
            while (w.running or not outcomes) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # anything delivered late would be here by now
            finals = [type(i).__name__ for i in job._items if isinstance(i, (Done, Failed))]
            assert finals == ["Failed"], (where, list(job._items))
            assert outcomes == ["error"], (where, outcomes)
        finally:
            release.set()
            w.stop()
