"""The server around the worker, on a tiny seeded model (fast): API keys and tenants, Prometheus
metrics, the bad-input battery (4xx, never 5xx), client disconnects, and `treedraft loadtest`.

Servers run on 127.0.0.1 in a background thread; every wait is bounded in time and every loop in count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from server_utils import LiveServer, assert_error, metric, parse_metrics, scrape, tiny_llm, wait_for  # noqa: E402

from treedraft import loadtest  # noqa: E402
from treedraft.api import LLM  # noqa: E402
from treedraft.cli import main  # noqa: E402
from treedraft.engine import GenerationStats, StepStats  # noqa: E402
from treedraft.server import APIKeys, Metrics, ServerSettings, create_app, tenant_id  # noqa: E402
from treedraft.server import auth as auth_mod  # noqa: E402
from treedraft.server.app import choice_seed  # noqa: E402

KEYS = ("key-one-0123456789", "key-two-abcdefghij")
CHAT = [{"role": "user", "content": "abc abc abc abc"}]
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only add contention on a shared CPU
    try:
        yield tiny_llm()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[LiveServer]:
    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.05, max_body_bytes=64 * 1024))) as s:
        yield s


@pytest.fixture(scope="module")
def key_server(llm: LLM) -> Iterator[LiveServer]:
    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.05, api_keys=KEYS))) as s:
        yield s


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def capture_tenants(s: LiveServer) -> list[str | None]:
    """Record the tenant of every job the app queues (wraps its submit)."""
    srv = s.app.state.treedraft
    seen: list[str | None] = []
    real = srv.submit

    def submit(p, *args, **kw):
        job = real(p, *args, **kw)
        seen.append(job.tenant)
        return job

    srv.submit = submit
    return seen


# ----------------------------------------------------------------------------- API keys


AUTH_CASES = [
    # (method, path, headers, status, error code or None)
    ("GET", "/v1/models", {}, 401, "missing_api_key"),
    ("GET", "/v1/models", bearer("wrong"), 401, "invalid_api_key"),
    ("GET", "/v1/models", bearer(KEYS[0][:-1]), 401, "invalid_api_key"),  # a prefix of a real key
    ("GET", "/v1/models", bearer(KEYS[0] + "x"), 401, "invalid_api_key"),
    ("GET", "/v1/models", bearer(KEYS[0].upper()), 401, "invalid_api_key"),
    ("GET", "/v1/models", {"Authorization": f"Basic {KEYS[0]}"}, 401, "invalid_api_key"),
    ("GET", "/v1/models", {"Authorization": "Bearer"}, 401, "invalid_api_key"),
    ("GET", "/v1/models", {"Authorization": KEYS[0]}, 401, "invalid_api_key"),
    ("GET", "/v1/models", {"X-API-Key": KEYS[0]}, 401, "missing_api_key"),
    ("POST", "/v1/chat/completions", {}, 401, "missing_api_key"),
    ("POST", "/v1/completions", bearer("nope"), 401, "invalid_api_key"),
    ("GET", "/v1/no-such-route", {}, 401, "missing_api_key"),  # no route probing without a key
    ("GET", "/docs", {}, 401, "missing_api_key"),
    ("GET", "/v1/no-such-route", bearer(KEYS[0]), 404, None),
    ("GET", "/v1/models", bearer(KEYS[0]), 200, None),
    ("GET", "/v1/models", bearer(KEYS[1]), 200, None),
    ("GET", "/v1/models", {"Authorization": f"bearer   {KEYS[1]}"}, 200, None),
    ("GET", "/health", {}, 200, None),
    ("GET", "/metrics", {}, 200, None),
    ("GET", "/health", bearer("wrong"), 200, None),  # open paths ignore the header
]


@pytest.mark.parametrize(
    "method,path,headers,status,code", AUTH_CASES, ids=[f"{i}-{c[1]}-{c[3]}" for i, c in enumerate(AUTH_CASES)]
)
def test_api_keys(key_server: LiveServer, method: str, path: str, headers: dict, status: int, code: str | None) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2} if method == "POST" else None
    r = httpx.request(method, f"{key_server.url}{path}", headers=headers, json=body, timeout=30)
    assert r.status_code == status, r.text
    if status == 401:
        err = assert_error(r, 401, None)
        assert err["type"] == "invalid_request_error" and err["code"] == code, err
        assert r.headers["www-authenticate"] == "Bearer"
        assert all(k not in r.text for k in KEYS)


def test_api_keys_with_the_openai_client_and_metrics(key_server: LiveServer) -> None:
    before = scrape(key_server.url)
    bad = openai.OpenAI(base_url=f"{key_server.url}/v1", api_key="sk-wrong", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    good = openai.OpenAI(base_url=f"{key_server.url}/v1", api_key=KEYS[1], max_retries=0, timeout=TIMEOUT)
    r = good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    after = scrape(key_server.url)
    assert (
        metric(after, "treedraft:request_errors_total", status="401")
        - metric(before, "treedraft:request_errors_total", status="401")
        == 1
    )
    assert metric(after, "treedraft:num_requests_total") - metric(before, "treedraft:num_requests_total") == 1


def test_tenant_is_the_key_hash_else_the_user_field(key_server: LiveServer, server: LiveServer) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 1}
    seen = capture_tenants(key_server)
    for key, user in ((KEYS[0], None), (KEYS[1], "alice"), (KEYS[0], "bob")):
        r = httpx.post(
            f"{key_server.url}/v1/chat/completions",
            json={**body, **({"user": user} if user else {})},
            headers=bearer(key),
            timeout=TIMEOUT,
        )
        assert r.status_code == 200, r.text
    assert seen == [tenant_id(KEYS[0]), tenant_id(KEYS[1]), tenant_id(KEYS[0])]  # the key wins over "user"
    assert tenant_id(KEYS[0]) != tenant_id(KEYS[1]) and all(k not in t for k in KEYS for t in seen)
    seen = capture_tenants(server)  # no keys configured: the request's "user" field, else anonymous
    for extra in ({"user": "alice"}, {}, {"user": "alice"}):
        assert (
            httpx.post(
                f"{server.url}/v1/completions",
                json={"model": "tiny", "prompt": "ab", "max_tokens": 1, **extra},
                timeout=TIMEOUT,
            ).status_code
            == 200
        )
    assert seen == ["user-alice", None, "user-alice"]
    # a long "user" is a fixed-size id (the store writes the tenant into every record: a 60 kB field cost 60 kB a
    # request on disk, and past 64 KiB the request's record was lost with a traceback in the log)
    seen = capture_tenants(server)
    for user in ("u" * 60_000, "u" * 60_000, "u" * 129):
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny", "prompt": "ab", "max_tokens": 1, "user": user},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200, r.text
    assert seen[0] == seen[1] != seen[2] and all(s.startswith("user-sha256-") and len(s) < 50 for s in seen)


def test_protect_health_metrics(llm: LLM) -> None:
    app = create_app(llm, ServerSettings(api_keys=KEYS[:1], protect_health_metrics=True))
    with LiveServer(app) as s:
        for path in ("/health", "/metrics"):
            err = assert_error(httpx.get(f"{s.url}{path}", timeout=10), 401, None)
            assert err["code"] == "missing_api_key"
            assert httpx.get(f"{s.url}{path}", headers=bearer(KEYS[0]), timeout=10).status_code == 200
        assert metric(scrape(s.url, bearer(KEYS[0])), "treedraft:request_errors_total", status="401") == 2


def test_every_key_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time across keys: the compare runs once per configured key, even when the first matches."""
    calls = []
    real = auth_mod.hmac.compare_digest
    monkeypatch.setattr(auth_mod.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    keys = APIKeys(["a1", "b2", "c3"])
    assert keys.tenant("Bearer a1") == tenant_id("a1")
    assert len(calls) == 3
    with pytest.raises(Exception, match="incorrect API key"):
        keys.tenant("Bearer zz")
    assert len(calls) == 6
    for bad in ([""], [" a"], "abc", ["clé-secret"], ["a\tb"]):  # (a header carries printable ASCII reliably)
        with pytest.raises(ValueError, match="API key"):
            APIKeys(bad)


def test_serve_cli_takes_keys_from_flags_and_env(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:

    import treedraft.cli
    import treedraft.server.cli as serve_cli

    got = {}
    monkeypatch.setattr(treedraft.cli, "load_from_args", lambda a: tiny_llm())
    monkeypatch.setattr(serve_cli, "create_app", lambda llm, settings: got.setdefault("settings", settings))
    monkeypatch.setattr(serve_cli, "run_server", lambda *a: got.setdefault("run", a))
    monkeypatch.setenv("TREEDRAFT_API_KEYS", "env-key-1, env-key-2,")
    assert main(["serve", "--api-key", "flag-key", "--protect-health-metrics"]) == 0
    s = got["settings"]
    assert s.api_keys == ("flag-key", "env-key-1", "env-key-2") and s.protect_health_metrics
    assert "flag-key" not in repr(s), "keys must not show up in logs of the settings"
    assert got["run"][1:] == ("127.0.0.1", 8000, "info", 30.0)  # app, host, port, log level, --shutdown-timeout
    monkeypatch.delenv("TREEDRAFT_API_KEYS")
    got.clear()
    assert main(["serve", "--protect-health-metrics"]) == 2
    assert "--api-key" in capsys.readouterr().err and not got
    assert main(["serve", "--api-key", " padded "]) == 2
    assert "whitespace" in capsys.readouterr().err
    got.clear()
    assert main(["serve", "--shutdown-timeout", "5"]) == 0 and got["run"][4] == 5.0
    got.clear()
    assert main(["serve", "--shutdown-timeout", "0.5"]) == 2 and not got
    assert "--shutdown-timeout must be 1 to 86400 s" in capsys.readouterr().err
    assert main(["serve", "--shutdown-timeout", "inf"]) == 2 and not got  # a timer of inf seconds overflowed


# ----------------------------------------------------------------------------- metrics


def test_metrics_record_and_render() -> None:
    m = Metrics("tiny")
    st = GenerationStats(prompt_tokens=5, new_tokens=6, t_decode=0.5)
    st.steps = [StepStats(4, 3, 2, 0, 0, 0), StepStats(1, 0, 0, 0, 0, 0), StepStats(3, 2, 0, 0, 0, 0)]
    m.record(st, 0.0, 0.25, 1.0, 2.0, 6, "stop", token_gaps=[0.003, 0.0, 0.0, 0.2, 0.05])
    m.record(GenerationStats(), 0.0, None, None, 0.1, 0, "aborted")
    m.observe_steps(1, 4)
    m.observe_steps(3)
    text = m.render()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) treedraft:\w+ .+", line), line
        else:
            assert 'model_name="tiny"' in line, line
    s = parse_metrics(text)

    def v(name: str, **labels: str) -> float:
        assert (name, frozenset(labels.items())) in s, (name, labels)
        return s[(name, frozenset(labels.items()))]

    assert v("treedraft:spec_decode_num_drafts_total") == 2
    assert v("treedraft:spec_decode_num_draft_tokens_total") == 3 + 2
    assert v("treedraft:spec_decode_num_accepted_tokens_total") == 2
    assert v("treedraft:spec_decode_num_verify_steps_total") == 3
    assert v("treedraft:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert ("treedraft:spec_decode_num_accepted_tokens_per_pos_total", frozenset({("position", "2")})) not in s
    assert v("treedraft:spec_decode_num_drafts_per_pos_total", position="2") == 1
    assert v("treedraft:spec_decode_num_drafts_per_pos_total", position="1") == 2
    assert v("treedraft:generation_tokens_total") == 6
    assert v("treedraft:prompt_tokens_total") == 5
    # (6 - 1) / 0.5: the first token is the prefill's (a review, session 44: 6 / 0.5 read n / (n - 1) too high)
    assert v("treedraft:generation_tokens_per_second") == 10
    one = Metrics("tiny")  # a one-token answer ran no decode step: no rate recorded (it read ~10^6 tok/s)
    one.record(GenerationStats(prompt_tokens=5, new_tokens=1, t_decode=1e-6), 0.0, 0.1, 0.2, 0.2, 1, "length")
    assert parse_metrics(one.render())[("treedraft:request_generation_tokens_per_second_count", frozenset())] == 0
    assert v("treedraft:request_success_total", finished_reason="stop") == 1
    assert v("treedraft:request_aborted_total") == 1
    assert v("treedraft:time_to_first_token_seconds_bucket", le="0.75") == 0
    assert v("treedraft:time_to_first_token_seconds_bucket", le="1.0") == 1
    assert v("treedraft:time_to_first_token_seconds_bucket", le="+Inf") == 1
    assert v("treedraft:time_to_first_token_seconds_count") == 1
    assert v("treedraft:e2e_request_latency_seconds_sum") == 2.0
    assert v("treedraft:request_queue_time_seconds_sum") == 0.25
    assert v("treedraft:inter_token_latency_seconds_count") == 5
    assert v("treedraft:inter_token_latency_seconds_bucket", le="0.001") == 2
    assert v("treedraft:inter_token_latency_seconds_bucket", le="0.0025") == 2
    assert v("treedraft:inter_token_latency_seconds_bucket", le="0.005") == 3
    assert v("treedraft:inter_token_latency_seconds_bucket", le="0.06") == 4
    assert v("treedraft:inter_token_latency_seconds_sum") == pytest.approx(0.253)
    assert v("treedraft:request_mean_accepted_length_count") == 1  # the aborted request had no steps
    assert v("treedraft:request_mean_accepted_length_sum") == pytest.approx((3 + 1 + 1) / 3)
    assert v("treedraft:batch_size_count") == 5 and v("treedraft:batch_size_sum") == 4 + 3
    assert v("treedraft:batch_size_bucket", le="2.0") == 4 and v("treedraft:batch_size_bucket", le="4.0") == 5


def test_metrics_registries_are_per_app() -> None:
    a, b = Metrics("tiny"), Metrics("tiny")  # one global registry would refuse the second
    a.error(400)
    assert metric(parse_metrics(a.render()), "treedraft:request_errors_total", status="400") == 1
    assert metric(parse_metrics(b.render()), "treedraft:request_errors_total", status="400") == 0


def test_prometheus_metrics_after_a_stream(server: LiveServer) -> None:
    before = scrape(server.url)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "xyz xyz xyz xyz xyz"}],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "treedraft": {"drafter": "prompt-lookup"},
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    usage, info = events[-1]["usage"], events[-1]["treedraft"]
    assert usage["completion_tokens"] == 24
    after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("treedraft:num_requests_total") == 1
    assert delta("treedraft:request_success_total", finished_reason="length") == 1
    assert delta("treedraft:generation_tokens_total") == 24
    assert delta("treedraft:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("treedraft:inter_token_latency_seconds_count") == 24 - 1
    assert delta("treedraft:time_to_first_token_seconds_count") == 1
    assert delta("treedraft:request_queue_time_seconds_count") == 1
    assert delta("treedraft:e2e_request_latency_seconds_count") == 1
    assert delta("treedraft:batch_size_count") == info["steps"] + 1  # prefill + verify steps, one request each
    assert delta("treedraft:batch_size_bucket", le="1.0") == info["steps"] + 1
    assert delta("treedraft:request_mean_accepted_length_count") == 1
    assert delta("treedraft:request_mean_accepted_length_sum") == pytest.approx(info["mean_accepted_length"], abs=1e-4)
    assert delta("treedraft:spec_decode_num_accepted_tokens_total") == info["accepted_tokens"]
    assert delta("treedraft:spec_decode_num_draft_tokens_total") == info["drafted_tokens"]
    assert metric(after, "treedraft:num_requests_running") == 0
    assert metric(after, "treedraft:num_requests_waiting") == 0
    assert ("treedraft:num_requests_created", frozenset()) in after
    # a scraper that asks for OpenMetrics gets it
    r = httpx.get(
        f"{server.url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}, timeout=10
    )
    assert r.headers["content-type"].startswith("application/openmetrics-text") and r.text.endswith("# EOF\n")


# ----------------------------------------------------------------------------- bad input: 4xx, never 5xx

_LONG_IDS = [10] * 5000  # longer than the 4096-token context
_HI = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    # (path, body: bytes or JSON-able, expected status, expected param or "any")
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}', 400, None),
    ("chat", b"not json at all", 400, None),
    ("chat", b"", 400, None),
    ("chat", b'{"messages": "\xff\xfe"}', 400, None),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}]} trailing', 400, None),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}', 400, "max_tokens"),
    ("chat", b"[" * 5000 + b"]" * 5000, 400, "any"),
    ("chat", b'{"messages": [{"role": "user", "content": "' + b"a" * 70000 + b'"}]}', 413, None),
    ("chat", [1, 2, 3], 400, "any"),
    ("chat", {"max_tokens": 4}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": "hello"}, 400, "messages"),
    ("chat", {"messages": {"role": "user", "content": "hi"}}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
    ("chat", {"messages": [{"role": 3, "content": "hi"}]}, 400, "messages.0.role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}, 400, "any"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "any"),
    ("chat", {"messages": [{"content": "hi"}]}, 400, "any"),
    ("chat", {"messages": [{"role": "user", "content": "   "}]}, 400, "messages"),
    ("chat", {"messages": _HI, "model": "gpt-17"}, 404, "model"),
    ("chat", {"messages": _HI, "model": 5}, 400, "model"),
    ("chat", {"messages": _HI, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": _HI, "max_tokens": -3}, 400, "max_tokens"),
    ("chat", {"messages": _HI, "max_tokens": 10**7}, 400, "max_tokens"),
    ("chat", {"messages": _HI, "max_tokens": 2**70}, 400, "max_tokens"),
    ("chat", {"messages": _HI, "max_tokens": 4090}, 400, "max_tokens"),
    ("chat", {"messages": _HI, "max_tokens": "5"}, 400, "max_tokens"),
    ("chat", {"messages": _HI, "max_tokens": 2.5}, 400, "max_tokens"),
    ("chat", {"messages": _HI, "max_tokens": True}, 400, "max_tokens"),
    ("chat", {"messages": _HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat", {"messages": _HI, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": _HI, "temperature": -1}, 400, "temperature"),
    ("chat", {"messages": _HI, "temperature": 2.5}, 400, "temperature"),
    ("chat", {"messages": _HI, "temperature": True}, 400, "temperature"),
    ("chat", {"messages": _HI, "top_p": 0}, 400, "top_p"),
    ("chat", {"messages": _HI, "top_p": 1.5}, 400, "top_p"),
    ("chat", {"messages": _HI, "top_p": "all"}, 400, "top_p"),
    ("chat", {"messages": _HI, "top_k": -1}, 400, "top_k"),
    ("chat", {"messages": _HI, "n": 17}, 400, "n"),
    ("chat", {"messages": _HI, "n": 0}, 400, "n"),
    ("chat", {"messages": _HI, "stream": "yes"}, 400, "stream"),
    ("chat", {"messages": _HI, "stop": 5}, 400, "stop"),
    ("chat", {"messages": _HI, "stop": [""]}, 400, "stop"),
    ("chat", {"messages": _HI, "stop": ""}, 400, "stop"),
    ("chat", {"messages": _HI, "stop": ["a", 3]}, 400, "stop"),
    ("chat", {"messages": _HI, "stop": {"a": 1}}, 400, "stop"),
    ("chat", {"messages": _HI, "stop": [["x"]]}, 400, "stop"),
    ("chat", {"messages": _HI, "seed": "x"}, 400, "seed"),
    ("chat", {"messages": _HI, "seed": 2**70}, 400, "seed"),
    ("chat", {"messages": _HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat", {"messages": _HI, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("chat", {"messages": _HI, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
    ("chat", {"messages": _HI, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400, "tools"),
    ("chat", {"messages": _HI, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("chat", {"messages": _HI, "response_format": {"type": "yaml"}}, 400, "response_format"),
    (
        "chat",
        {
            "messages": _HI,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"patternProperties": {}}}},
        },
        400,
        "response_format",
    ),
    ("chat", {"messages": _HI, "response_format": {"type": "json_object"}, "ignore_eos": True}, 400, "ignore_eos"),
    ("chat", {"messages": _HI, "response_format": {"type": "json_object"}, "min_tokens": 2}, 400, "min_tokens"),
    ("chat", {"messages": _HI, "logit_bias": {"5": 101.0}}, 400, "logit_bias"),
    ("chat", {"messages": _HI, "logit_bias": {"x": 1.0}}, 400, "logit_bias"),
    ("chat", {"messages": _HI, "logit_bias": {"-1": 1.0}}, 400, "logit_bias"),
    ("chat", {"messages": _HI, "logit_bias": {"\u00b2": 1.0}}, 400, "logit_bias"),  # a digit, not ASCII
    ("chat", {"messages": _HI, "logit_bias": {"1": 1.0, "01": 2.0}}, 400, "logit_bias"),
    ("chat", {"messages": _HI, "logit_bias": {"96": 1.0}}, 400, "logit_bias"),  # the tiny vocabulary is 0..95
    ("chat", {"messages": _HI, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("chat", {"messages": _HI, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("chat", {"messages": _HI, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("chat", {"messages": _HI, "repetition_penalty": "high"}, 400, "repetition_penalty"),
    ("chat", {"messages": _HI, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (
        "chat",
        {"messages": _HI, "stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
    ),
    ("chat", {"messages": _HI, "treedraft": {"drafter": "bogus"}}, 400, "treedraft.drafter"),
    ("chat", {"messages": _HI, "treedraft": {"rule": "bogus"}}, 400, "treedraft.rule"),
    ("chat", {"messages": _HI, "treedraft": {"max_tree_nodes": 0}}, 400, "treedraft.max_tree_nodes"),
    ("chat", {"messages": _HI, "treedraft": {"colour": "red"}}, 400, "treedraft.colour"),
    ("chat", {"messages": _HI, "treedraft": "fast"}, 400, "treedraft"),
    ("chat", {"messages": _HI, "treedraft": {"drafter": "medusa"}}, 400, "treedraft.drafter"),  # no heads here
    ("chat", {"messages": [{"role": "user", "content": "hello " * 5000}]}, 400, "messages"),
    ("completions", {"prompt": _LONG_IDS}, 400, "prompt"),
    ("completions", {"prompt": "word " * 6000, "max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": [10**9]}, 400, "prompt"),
    ("completions", {"prompt": [-1]}, 400, "prompt"),
    ("completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("completions", {"prompt": [[1, 2], [10**9]]}, 400, "prompt"),
    ("completions", {"prompt": [[1, 2], "a"]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [[]]}, 400, "prompt"),
    ("completions", {"prompt": ["a"] * 40, "n": 2}, 400, "prompt"),  # 80 jobs: more than the queue's 64
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": None}, 400, "prompt"),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("completions", {"prompt": "hello there my good friend", "max_tokens": 4095}, 400, "max_tokens"),
    # NaN / Infinity (Python's json writes them): "not a finite number", not "less than or equal to 2"
    ("chat", {"messages": _HI, "temperature": float("nan")}, 400, "temperature"),
    ("chat", {"messages": _HI, "top_p": float("inf")}, 400, "top_p"),
    ("completions", {"prompt": "hi", "logit_bias": {"1": float("nan")}}, 400, "logit_bias.1"),
]


@pytest.mark.parametrize(
    "path,body,status,param", BAD_REQUESTS, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_REQUESTS)]
)
def test_bad_requests_get_openai_errors(
    server: LiveServer, path: str, body: object, status: int, param: str | None
) -> None:
    url = f"{server.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}"
    if isinstance(body, dict):
        body = {"model": "tiny", **body}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    err = assert_error(r, status, param)
    assert err["type"] == "invalid_request_error"
    if (b"NaN" in content or b"Infinity" in content) and param in ("temperature", "top_p", "logit_bias.1"):
        assert "finite number" in err["message"], err


def test_an_oversize_chunked_body_is_a_413_and_a_body_at_the_limit_is_read(server: LiveServer) -> None:
    """Without a Content-Length (chunked upload) the body is counted as it arrives: one over the limit is a 413; a
    small one sent in many chunks is read whole."""
    url = f"{server.url}/v1/chat/completions"
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * 70000 + b'"}]}'
    r = httpx.post(url, content=(big[i : i + 4096] for i in range(0, len(big), 4096)), timeout=60)
    assert "limit" in assert_error(r, 413, None)["message"]
    small = json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 2, "temperature": 0}).encode()
    r = httpx.post(url, content=(small[i : i + 7] for i in range(0, len(small), 7)), timeout=60)
    assert r.status_code == 200, r.text
    # a declared length over the limit is answered before any of the body is sent (it never is, here)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {10**9}\r\n\r\n".encode())
        assert sock.recv(4096).split(b"\r\n", 1)[0] == b"HTTP/1.1 413 Request Entity Too Large"


_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_FIELD_VALUES = {
    "model": st.sampled_from(["tiny", "other"]) | _ANY_JSON,
    "messages": st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]) | _ANY_JSON,
                "content": st.text(max_size=20) | _ANY_JSON,
            },
        ),
        max_size=3,
    )
    | _ANY_JSON,
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 200), max_size=5) | _ANY_JSON,
    "max_tokens": st.integers(-3, 12) | st.integers() | _ANY_JSON,
    "temperature": st.floats(-1, 3) | _ANY_JSON,
    "top_p": st.floats(-0.5, 1.5) | _ANY_JSON,
    "top_k": st.integers(-2, 50) | _ANY_JSON,
    "seed": st.integers() | _ANY_JSON,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | _ANY_JSON,
    "n": st.integers(-1, 3) | _ANY_JSON,
    "stream": st.booleans() | _ANY_JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _ANY_JSON,
    "ignore_eos": st.booleans() | _ANY_JSON,
    "treedraft": st.fixed_dictionaries(
        {},
        optional={
            "drafter": st.sampled_from(["none", "prompt-lookup", "x"]),
            "rule": st.sampled_from(["typical", "greedy", "y"]),
            "max_tree_nodes": st.integers(-1, 600),
        },
    )
    | _ANY_JSON,
}


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), body=st.fixed_dictionaries({}, optional=_FIELD_VALUES))
def test_random_bodies_never_get_5xx(server: LiveServer, chat: bool, body: dict) -> None:
    """Fuzzed requests (valid and not) are answered 200 or a 4xx OpenAI error, never a 5xx."""
    url = f"{server.url}/v1/{'chat/completions' if chat else 'completions'}"
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 12:
        body["max_tokens"] = 10**9  # a large valid-looking value stays a 400, not a long generation
    body.setdefault("max_tokens", 4)
    r = httpx.post(url, json=body, timeout=TIMEOUT)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
        assert_error(r, r.status_code)


def test_a_tiny_temperature_is_greedy_and_an_extreme_repetition_penalty_a_400(server: LiveServer) -> None:
    """temperature 1e-38 (below GREEDY_BELOW) answers as greedy instead of failing with a 500 (float32 logits
    divided by it overflowed, so sampling found no mass); a repetition penalty outside [0.01, 10] is a 400."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 6, "ignore_eos": True, "treedraft": {"drafter": "none"}}
    greedy = httpx.post(url, json=body | {"temperature": 0}, timeout=TIMEOUT)
    assert greedy.status_code == 200, greedy.text
    for t in (1e-38, 1e-45, 5e-324, 1e-6):
        r = httpx.post(url, json=body | {"temperature": t, "seed": 3}, timeout=TIMEOUT)
        assert r.status_code == 200, (t, r.text)
        assert r.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]
    for rep in (1e-300, 1e-40, 0.009):
        r = httpx.post(url, json=body | {"temperature": 0.7, "repetition_penalty": rep}, timeout=TIMEOUT)
        assert_error(r, 400, "repetition_penalty")
    r = httpx.post(url, json=body | {"temperature": 0.7, "repetition_penalty": 0.01, "seed": 1}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def test_openai_fields_that_would_change_the_answer_are_refused_by_name(server: LiveServer) -> None:
    """The deprecated functions / function_call, audio, web search and non-text modalities are a 400 naming the
    field (they were dropped silently: the answer came back as text without a call); fields that change nothing
    here (store, metadata, modalities ["text"]) are accepted."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2, "temperature": 0}
    fn = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    for extra, param in (
        ({"functions": [fn], "function_call": {"name": "f"}}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
    ):
        err = assert_error(httpx.post(url, json=body | extra, timeout=TIMEOUT), 400, param)
        assert "tools" in err["message"] if param.startswith("function") else err["message"]
    ok = body | {"store": True, "metadata": {"a": "b"}, "modalities": ["text"], "functions": None}
    assert httpx.post(url, json=ok, timeout=TIMEOUT).status_code == 200


def test_one_model_can_be_retrieved_and_health_answers_head(server: LiveServer) -> None:
    """client.models.retrieve (GET /v1/models/{id}) gives the listing's entry, an unknown id a 404 naming it;
    HEAD /health (load balancers' probe) is a 200 like GET."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    listed = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()["data"]
    got = client.models.retrieve("tiny")
    assert got.id == "tiny" and got.model_dump(exclude_none=True) == next(m for m in listed if m["id"] == "tiny")
    r = httpx.get(f"{server.url}/v1/models/other-model", timeout=TIMEOUT)
    assert "other-model" in assert_error(r, 404, None)["message"]
    assert httpx.head(f"{server.url}/health", timeout=TIMEOUT).status_code == 200


def test_every_answer_carries_an_x_request_id(server: LiveServer) -> None:
    """OpenAI's API sends x-request-id (its SDK shows it with errors and in logs; a review found none): a new one per
    answer, errors and streams included, or the client's own echoed; an unprintable or long one is replaced."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 3, "temperature": 0}
    a, b = (httpx.post(url, json=body, timeout=TIMEOUT) for _ in range(2))
    ids = [r.headers.get("x-request-id", "") for r in (a, b)]
    assert all(i.startswith("req-") for i in ids) and ids[0] != ids[1]
    assert httpx.post(url, json=body, headers={"x-request-id": "mine-1"}, timeout=TIMEOUT).headers["x-request-id"] == (
        "mine-1"
    )
    assert (
        httpx.post(url, json=body, headers={"x-request-id": "x" * 200}, timeout=TIMEOUT)
        .headers["x-request-id"]
        .startswith("req-")
    )
    bad = httpx.post(url, json={**body, "temperature": -1}, timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.headers["x-request-id"].startswith("req-")
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.headers["x-request-id"].startswith("req-") and "".join(r.iter_text()).rstrip().endswith("[DONE]")
    raw = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0).chat.completions.with_raw_response
    assert raw.create(model="tiny", messages=CHAT, max_tokens=2).headers["x-request-id"].startswith("req-")


def test_a_prediction_changes_nothing_but_is_drafted_from_and_counted(server: LiveServer) -> None:
    """OpenAI's predicted outputs: the answer equals the one without a prediction, the drafters accept the
    prediction's tokens (more accepted per step), and usage.completion_tokens_details counts the prediction's tokens
    found in the answer and the rest, streamed or not."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    body |= {"treedraft": {"drafter": "prompt-lookup"}}
    plain = httpx.post(url, json=body, timeout=TIMEOUT).json()
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]
    with_pred = httpx.post(
        url, json=body | {"prediction": {"type": "content", "content": text + "~~~"}}, timeout=TIMEOUT
    )
    out = with_pred.json()
    assert out["choices"][0]["message"]["content"] == text
    assert out["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 40,
        "rejected_prediction_tokens": 3,
    }
    assert out["treedraft"]["mean_accepted_length"] > 1.2 * plain["treedraft"]["mean_accepted_length"]  # drafted from
    parts = {"type": "content", "content": [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]}
    events = _sse_events(
        httpx.post(
            url,
            json=body | {"prediction": parts, "stream": True, "stream_options": {"include_usage": True}},
            timeout=TIMEOUT,
        )
    )
    assert "".join(ch["delta"].get("content") or "" for ev in events for ch in ev["choices"]) == text
    assert events[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 40
    for bad, param in (
        ({"type": "text", "content": text}, "prediction"),
        ({"type": "content", "content": 5}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content"),
    ):
        assert_error(httpx.post(url, json=body | {"prediction": bad}, timeout=TIMEOUT), 400, param)


def test_stop_token_ids_end_the_answer(server: LiveServer) -> None:
    """vLLM's stop_token_ids: the tiny model's answer is all "b" (id 66), so stopping on it gives an empty answer
    that ended ("stop"), its id not reported as content in the logprobs; a bad id is a 400."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True}
    out = httpx.post(url, json=body | {"stop_token_ids": [66]}, timeout=TIMEOUT).json()["choices"][0]
    assert out["message"]["content"] == "" and out["finish_reason"] == "stop"
    assert out["logprobs"]["content"] == []
    assert_error(httpx.post(url, json=body | {"stop_token_ids": [10**6]}, timeout=TIMEOUT), 400, "stop_token_ids")


def test_min_p_reaches_the_sampler(server: LiveServer) -> None:
    """min_p (vLLM's extra) 1.0 keeps the best token alone: sampled at temperature 1.5 the answer is the greedy
    one, and without min_p it is not; outside [0, 1] it is a 400."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 24, "ignore_eos": True, "treedraft": {"drafter": "none"}}
    greedy = httpx.post(url, json=body | {"temperature": 0}, timeout=TIMEOUT).json()["choices"][0]["message"]
    hot = body | {"temperature": 1.5, "seed": 11}
    free = httpx.post(url, json=hot, timeout=TIMEOUT).json()["choices"][0]["message"]
    only_best = httpx.post(url, json=hot | {"min_p": 1.0}, timeout=TIMEOUT).json()["choices"][0]["message"]
    assert only_best["content"] == greedy["content"] != free["content"]
    assert_error(httpx.post(url, json=hot | {"min_p": 1.5}, timeout=TIMEOUT), 400, "min_p")


def test_guided_choice_and_regex_constrain_the_answer(server: LiveServer) -> None:
    """vLLM's guided_choice / guided_regex / structured_outputs: the answer is one of the strings or a full match
    (greedy and sampled, streamed or not); two constraints at once, a bad expression or one next to a JSON
    response_format is a 400 naming the field."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 12}
    choices = ["cab", "b b", "abc"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices, "json": None}}):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
            r = httpx.post(url, json=body | extra | sampling, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] in choices
    rx = {"guided_regex": "(ab|c)+ ?b{2,3}"}
    out = httpx.post(url, json=body | rx | {"temperature": 0}, timeout=TIMEOUT).json()["choices"][0]
    assert out["finish_reason"] == "length" or re.fullmatch(rx["guided_regex"], out["message"]["content"]), out
    events = _sse_events(httpx.post(url, json=body | rx | {"temperature": 0, "stream": True}, timeout=TIMEOUT))
    assert (
        "".join(ch["delta"].get("content") or "" for ev in events for ch in ev["choices"]) == out["message"]["content"]
    )
    for bad, param in (
        ({"guided_regex": "ok[", "temperature": 0}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"choice": 5}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_choice": ["bb"], "stop_token_ids": [66]}, "stop_token_ids"),
    ):
        assert_error(httpx.post(url, json=body | bad, timeout=TIMEOUT), 400, param)


# ----------------------------------------------------------------------------- disconnects


def _sse_events(r: httpx.Response) -> list[dict]:
    """The JSON events of a streamed response, without the final [DONE]."""
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def test_chat_logprobs_follow_the_tokens_streamed_or_not(server: LiveServer) -> None:
    """Greedy chat with top_logprobs 3: one entry per generated token, the token its row's best, the same values
    whether streamed or not, and the entries' tokens spell the answer."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": True, "top_logprobs": 3}
    r = httpx.post(url, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 12
    assert "".join(e["token"] for e in content) == out["choices"][0]["message"]["content"]
    for e in content:
        tops = e["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert (tops[0]["token"], tops[0]["logprob"]) == (e["token"], e["logprob"]) and e["logprob"] <= 0.0
        assert e["bytes"] == list(e["token"].encode())
    streamed = httpx.post(url, json=body | {"stream": True}, timeout=TIMEOUT)
    events = _sse_events(streamed)
    got = [e for ev in events for ch in ev["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in got] == [e["token"] for e in content]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-5 for a, b in zip(got, content, strict=True))
    plain = httpx.post(url, json={k: v for k, v in body.items() if "logprobs" not in k}, timeout=TIMEOUT).json()
    assert plain["choices"][0]["logprobs"] is None  # off unless asked


def test_completion_logprobs_have_offsets_and_top_alternatives(server: LiveServer) -> None:
    url = f"{server.url}/v1/completions"
    body = {"model": "tiny", "prompt": "abc abc abc", "max_tokens": 8, "temperature": 0.9, "seed": 4}
    body |= {"ignore_eos": True, "logprobs": 2}
    out = httpx.post(url, json=body, timeout=TIMEOUT).json()
    lp = out["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == out["choices"][0]["text"] and len(lp["tokens"]) == 8
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    assert all(len(top) == 2 and max(top.values()) >= v for top, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    streamed = _sse_events(httpx.post(url, json=body | {"stream": True}, timeout=TIMEOUT))
    parts = [ch["logprobs"] for ev in streamed for ch in ev["choices"] if ch["logprobs"]]
    assert [t for x in parts for t in x["tokens"]] == lp["tokens"]  # seeded: the same draws
    assert [o for x in parts for o in x["text_offset"]] == lp["text_offset"]


def test_completion_echo_scores_the_prompt(server: LiveServer, llm: LLM) -> None:
    """echo + logprobs (how evaluation harnesses score a text): the prompt comes back first with each token's
    log-probability given the ones before it (the first: null), equal to a whole-prompt forward's log-softmax."""
    url = f"{server.url}/v1/completions"
    prompt = "abc abd abc ab"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    out = httpx.post(url, json=body | {"echo": True, "logprobs": 1}, timeout=TIMEOUT).json()
    choice, ids = out["choices"][0], llm.encode_prompt(prompt, raw=True)
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt) and len(lp["tokens"]) == len(ids) + 2
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.inference_mode():
        logits, _ = llm.model.forward(torch.tensor([ids]), torch.arange(len(ids)), None, 0)
    ref = logits[0].double().log_softmax(-1)
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) < 1e-4, j
        assert len(lp["top_logprobs"][j]) == 1
    answer = httpx.post(url, json=body | {"logprobs": 1}, timeout=TIMEOUT).json()["choices"][0]
    assert choice["text"] == prompt + answer["text"]
    assert lp["token_logprobs"][len(ids) :] == answer["logprobs"]["token_logprobs"]
    plain = httpx.post(url, json=body | {"echo": True}, timeout=TIMEOUT).json()["choices"][0]
    assert plain["text"] == choice["text"] and plain["logprobs"] is None
    events = _sse_events(httpx.post(url, json=body | {"echo": True, "stream": True}, timeout=TIMEOUT))
    assert events[0]["choices"][0]["text"] == prompt
    assert "".join(ch["text"] for ev in events for ch in ev["choices"]) == choice["text"]


def test_penalties_reach_the_engine(server: LiveServer, llm: LLM) -> None:
    """presence / frequency (OpenAI) and repetition (vLLM's extra) penalties: the server's greedy text is the
    engine's with the same penalties, and not the text without them."""
    url = f"{server.url}/v1/completions"
    prompt = "abc abc abc abc ab"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    pen = {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.8}
    got = httpx.post(url, json=body | pen, timeout=TIMEOUT).json()["choices"][0]["text"]
    config = dataclasses.replace(llm.config(max_new_tokens=16, **pen), ignore_eos=True)
    want = llm.text.generate(llm.encode_prompt(prompt, raw=True), config, None).text
    assert got == want
    assert got != httpx.post(url, json=body, timeout=TIMEOUT).json()["choices"][0]["text"]
    banned = {str(ord(c) - 32): -100 for c in "abc "}  # the tiny tokenizer: one id per character
    forced = httpx.post(url, json=body | {"logit_bias": banned | {"90": 100}}, timeout=TIMEOUT).json()
    assert forced["choices"][0]["text"] == chr(32 + 90) * 16  # +100 on one token: greedy takes it every time
    free = httpx.post(url, json=body | {"logit_bias": banned}, timeout=TIMEOUT).json()["choices"][0]["text"]
    assert free and not set(free) & set("abc ")


def test_json_mode_reaches_the_engine(server: LiveServer, llm: LLM) -> None:
    """response_format json_object (chat and completions, greedy and seeded, streamed): the text is the engine's
    JSON-mode text and a JSON object's prefix (the whole object where it stops), and not the free text."""
    from treedraft.grammar import DONE, run

    url = f"{server.url}/v1/completions"
    prompt = "abc abc abc abc ab"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    fmt = {"response_format": {"type": "json_object"}}
    out = httpx.post(url, json=body | fmt, timeout=TIMEOUT).json()["choices"][0]
    want = llm.text.generate(llm.encode_prompt(prompt, raw=True), llm.config(40, response_format="json_object"))
    assert out["text"] == want.text
    assert out["text"] != httpx.post(url, json=body, timeout=TIMEOUT).json()["choices"][0]["text"]
    end = run((0, 0, 0, ()), out["text"].encode())
    assert end is not None and (end[0] == DONE or out["finish_reason"] == "length")
    chat = f"{server.url}/v1/chat/completions"
    sampled = {"model": "tiny", "messages": CHAT, "max_tokens": 30, "temperature": 1.0, "seed": 3, "n": 2} | fmt
    texts = [c["message"]["content"] for c in httpx.post(chat, json=sampled, timeout=TIMEOUT).json()["choices"]]
    streamed = ["", ""]
    with httpx.stream("POST", chat, json=sampled | {"stream": True}, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] += c["delta"].get("content") or ""
    assert streamed == texts
    for t in texts:
        assert run((0, 0, 0, ()), t.encode()) is not None
    schema = {"type": "object", "properties": {"ab": {"type": "boolean"}}, "required": ["ab"]}
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    out = httpx.post(url, json=body | fmt, timeout=TIMEOUT).json()["choices"][0]
    want = llm.text.generate(
        llm.encode_prompt(prompt, raw=True), llm.config(40, response_format=fmt["response_format"])
    )
    assert out["text"] == want.text and out["text"].lstrip().startswith('{"ab"')


def test_openai_sdk_parse_with_a_pydantic_model(server: LiveServer) -> None:
    """The OpenAI SDK's structured outputs (``chat.completions.parse`` with a pydantic model: a strict json_schema
    with $defs, $ref, anyOf with null and enums): the answer is parsed into the model."""
    import enum
    from typing import Literal

    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class Kind(str, enum.Enum):
        x = "x"

    class Inner(pydantic.BaseModel):
        kind: Kind

    class Answer(pydantic.BaseModel):
        ab: Literal["ab", "ba"]
        inner: Inner
        flag: bool | None

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    out = client.chat.completions.parse(
        model="tiny", messages=CHAT, response_format=Answer, max_tokens=400, temperature=0
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content  # closed well within max_tokens
    assert isinstance(choice.message.parsed, Answer) and choice.message.parsed.inner.kind == Kind.x
    assert choice.message.parsed == Answer.model_validate_json(choice.message.content)


def _streamed_choice(url: str, body: dict) -> tuple[list[str], list[dict], str | None]:
    """A streamed chat answer (one choice): its content pieces, its tool_calls deltas and its finish reason."""
    parts, calls, finish = [], [], None
    for ev in _sse_events(httpx.post(url, json=body | {"stream": True}, timeout=TIMEOUT)):
        for c in ev["choices"]:
            parts += [c["delta"]["content"]] if c["delta"].get("content") else []
            calls += c["delta"].get("tool_calls", [])
            finish = c["finish_reason"] or finish
    return parts, calls, finish


TOOLS = [
    {"type": "function", "function": {"name": "abc", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}}},
    {"type": "function", "function": {"name": "xyz", "description": "No arguments."}},
]  # fmt: skip


def test_tool_calls(server: LiveServer, llm: LLM) -> None:
    """tools with tool_choice required / a named tool / auto: the answer is the engine's constrained answer to the
    rendered messages, returned as tool_calls (finish_reason "tool_calls") with arguments valid for the tool; the
    stream gives the same call; an earlier call and its result are accepted as history; the SDK reads the call."""
    from treedraft.tools import answer_schema, parse_tools, render_messages

    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "max_tokens": 400, "temperature": 0}
    for choice in ("required", {"type": "function", "function": {"name": "xyz"}}):
        out = httpx.post(url, json=body | {"tool_choice": choice}, timeout=TIMEOUT).json()["choices"][0]
        mode = "required" if choice == "required" else "fn:xyz"
        tools = parse_tools(TOOLS)
        ids = llm.encode_prompt(render_messages(CHAT, tools, mode))
        fmt = {"type": "json_schema", "json_schema": {"schema": answer_schema(tools, mode)}}
        want = llm.text.generate(ids, llm.config(400, response_format=fmt))
        assert want.finish_reason == "stop" and out["finish_reason"] == "tool_calls"
        assert out["message"]["content"] is None
        (call,) = out["message"]["tool_calls"]
        assert {call["function"]["name"]: json.loads(call["function"]["arguments"])} == json.loads(want.text)
        assert mode == "required" or call["function"]["name"] == "xyz"
        parts, (streamed,), finish = _streamed_choice(url, body | {"tool_choice": choice})
        assert not parts  # nothing of the JSON leaks as text
        assert finish == "tool_calls" and streamed["index"] == 0
        assert streamed["function"] == call["function"] and streamed["id"].startswith("call_")
        # cut by max_tokens: the call so far (finish "length"), or before its name nothing, never the JSON as text
        name = call["function"]["name"]
        for m in (2, len(want.token_ids) - 2):
            cut = httpx.post(url, json=body | {"tool_choice": choice, "max_tokens": m}, timeout=TIMEOUT).json()
            cut = cut["choices"][0]
            part = llm.text.generate(ids, llm.config(m, response_format=fmt)).text
            assert cut["finish_reason"] == "length" and len(part) < len(want.text), part
            parts, calls, finish = _streamed_choice(url, body | {"tool_choice": choice, "max_tokens": m})
            assert finish == "length" and not parts
            if f'"{name}"' in part or mode != "required":  # the name is known (its key closed, or named)
                args = part[part.index(":") + 1 :].lstrip() if ":" in part else ""
                assert cut["message"]["content"] is None and not part.endswith("}")
                assert cut["message"]["tool_calls"][0]["function"] == {"name": name, "arguments": args}
                assert calls[0]["function"] == {"name": name, "arguments": args}
            else:
                assert cut["message"] == {"role": "assistant", "content": ""} and not calls
    # tool_choice auto: a call, or (with "r" and '"' favoured: the key "response", then r's up to max_tokens) a text
    # answer, cut by the budget
    for extra in ({}, {"logit_bias": {str(ord("r") - 32): 100, str(ord('"') - 32): 50}, "max_tokens": 60}):
        auto = httpx.post(url, json=body | extra, timeout=TIMEOUT).json()["choices"][0]
        parts, calls, finish = _streamed_choice(url, body | extra)
        assert finish == auto["finish_reason"] == ("length" if extra else "tool_calls")
        if finish == "tool_calls":
            assert not parts and calls[0]["function"] == auto["message"]["tool_calls"][0]["function"]
        else:  # a "response": its text streams as it is written, not as JSON
            assert "".join(parts) == auto["message"]["content"] and not calls
            assert set(auto["message"]["content"]) == {"r"} and len(parts) > 1
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "abc", "arguments": '{"n": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]  # fmt: skip
    r = httpx.post(url, json=body | {"messages": history, "tool_choice": "required"}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
    plain = httpx.post(url, json=body | {"tool_choice": "none", "max_tokens": 8}, timeout=TIMEOUT).json()
    assert plain["choices"][0]["message"]["content"] and "tool_calls" not in plain["choices"][0]["message"]
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    sdk = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                         max_tokens=400, temperature=0)  # fmt: skip
    assert sdk.choices[0].message.tool_calls[0].function.name in ("abc", "xyz")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "format": "uri-reference"}}}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "stop": ["}"]}, "stop"),  # it could cut the call
        ({"tools": [{"type": "function", "function": {"name": "response"}}]}, "tools"),  # auto's answer key
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400(server: LiveServer, extra: dict, param: str) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4} | extra
    assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT), 400, param)


def test_min_tokens_holds_the_end_back(server: LiveServer) -> None:
    """A bias that makes EOS (95) the best token everywhere: with min_tokens 3 the answer has exactly 3 tokens and
    stops at EOS; without it none; min_tokens above max_tokens is a 400."""
    url = f"{server.url}/v1/completions"
    body = {"model": "tiny", "prompt": "abc abc", "max_tokens": 10, "temperature": 0, "logit_bias": {"95": 50}}
    out = httpx.post(url, json=body | {"min_tokens": 3}, timeout=TIMEOUT).json()
    assert out["usage"]["completion_tokens"] == 4 and len(out["choices"][0]["text"]) == 3  # 3 + the EOS
    assert out["choices"][0]["finish_reason"] == "stop"
    assert httpx.post(url, json=body, timeout=TIMEOUT).json()["choices"][0]["text"] == ""
    assert_error(httpx.post(url, json=body | {"min_tokens": 11}, timeout=TIMEOUT), 400, "min_tokens")


def test_several_prompts_are_answered_in_order_as_alone(server: LiveServer) -> None:
    """A list of prompts (strings or token-id lists, OpenAI's batch form): one choice per prompt and choice, prompt
    by prompt, each the answer the prompt gets alone; prompt tokens counted once per prompt."""
    url = f"{server.url}/v1/completions"
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    prompts = ["abc abc ab", "xyz", "hello hello hel"]
    alone = [httpx.post(url, json=body | {"prompt": q}, timeout=TIMEOUT).json() for q in prompts]
    out = httpx.post(url, json=body | {"prompt": prompts}, timeout=TIMEOUT).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert [c["logprobs"]["tokens"] for c in out["choices"]] == [a["choices"][0]["logprobs"]["tokens"] for a in alone]
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone) == 28
    assert out["usage"]["completion_tokens"] == 15
    ids = [[ord(c) - 32 for c in q] for q in prompts]  # the tiny tokenizer: one id per character
    by_ids = httpx.post(url, json=body | {"prompt": ids}, timeout=TIMEOUT).json()
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in out["choices"]]
    two = httpx.post(url, json=body | {"prompt": prompts[:2], "n": 2}, timeout=TIMEOUT).json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in two["choices"]] == [alone[0]["choices"][0]["text"]] * 2 + [
        alone[1]["choices"][0]["text"]
    ] * 2  # greedy: a prompt's choices agree
    assert two["usage"]["prompt_tokens"] == 13


def test_echoed_prompt_is_scored_once_for_all_its_choices(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """echo + logprobs with n = 3 over two prompts: each prompt is scored once (not once per choice), and every
    choice reports the same prompt logprobs, streamed or not."""
    from treedraft.server import worker as worker_mod

    calls: list[int] = []
    real = worker_mod.prompt_logprobs

    def counted(model, ids, top):
        calls.append(len(ids))
        return real(model, ids, top)

    monkeypatch.setattr(worker_mod, "prompt_logprobs", counted)
    url = f"{server.url}/v1/completions"
    body = {"model": "tiny", "prompt": ["abc abd ab", "xyz xy"], "max_tokens": 3, "temperature": 1.0, "seed": 2}
    body |= {"echo": True, "logprobs": 1, "n": 3, "ignore_eos": True}
    out = httpx.post(url, json=body, timeout=TIMEOUT).json()
    assert sorted(calls) == [6, 10]
    for k, q in enumerate(["abc abd ab", "xyz xy"]):
        lps = [c["logprobs"]["token_logprobs"][: len(q)] for c in out["choices"][3 * k : 3 * k + 3]]
        assert lps[0] == lps[1] == lps[2] and lps[0][0] is None and all(v is not None for v in lps[0][1:])
        assert all(c["text"].startswith(q) for c in out["choices"][3 * k : 3 * k + 3])
    calls.clear()
    events = _sse_events(httpx.post(url, json=body | {"stream": True}, timeout=TIMEOUT))
    assert sorted(calls) == [6, 10]
    echoed = [ch["logprobs"]["token_logprobs"] for ev in events for ch in ev["choices"] if ch["logprobs"]]
    assert sum(1 for x in echoed if x and x[0] is None) == 6  # every choice's echo chunk carries the scores


def test_echo_with_max_tokens_zero_scores_the_prompt_only(server: LiveServer) -> None:
    """max_tokens 0 with echo (how evaluation harnesses score texts, several at a time): the prompt back with the
    same logprobs as echo with a generated token, nothing generated, finish_reason length."""
    url = f"{server.url}/v1/completions"
    prompts = ["abc abd abc ab", "the cat the ca"]
    body = {"model": "tiny", "prompt": prompts, "temperature": 0, "echo": True, "logprobs": 2}
    out = httpx.post(url, json=body | {"max_tokens": 0}, timeout=TIMEOUT).json()
    one = httpx.post(url, json=body | {"max_tokens": 1, "ignore_eos": True}, timeout=TIMEOUT).json()
    assert out["usage"] == {"prompt_tokens": 28, "completion_tokens": 0, "total_tokens": 28}
    for q, c, d in zip(prompts, out["choices"], one["choices"], strict=True):
        assert c["text"] == q and c["finish_reason"] == "length"
        lp, ref = c["logprobs"], d["logprobs"]
        assert len(lp["tokens"]) == len(q) and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"] == ref["token_logprobs"][: len(q)]
        assert lp["text_offset"] == list(range(len(q)))
    streamed = _sse_events(
        httpx.post(url, json=body | {"prompt": prompts[0], "max_tokens": 0, "stream": True}, timeout=TIMEOUT)
    )
    assert "".join(ch["text"] for ev in streamed for ch in ev["choices"]) == prompts[0]
    plain = httpx.post(
        url, json={k: v for k, v in body.items() if k != "logprobs"} | {"max_tokens": 0}, timeout=TIMEOUT
    )
    assert [c["text"] for c in plain.json()["choices"]] == prompts


def _by_index(events: list[dict], chat: bool) -> dict[int, str]:
    """Each choice's streamed text, by index."""
    out: dict[int, str] = {}
    for ev in events:
        for ch in ev["choices"]:
            piece = (ch["delta"].get("content") or "") if chat else ch["text"]
            out[ch["index"]] = out.get(ch["index"], "") + piece
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_choices_and_prompts_equal_the_whole_answers(server: LiveServer, chat: bool) -> None:
    """n = 3 seeded (and for completions two prompts x n = 2) streamed: each index's pieces join to the
    non-streamed choice of that index, every choice ends with a finish_reason, and the usage at the end counts
    them all."""
    path = "chat/completions" if chat else "completions"
    body: dict = {"model": "tiny", "max_tokens": 6, "temperature": 1.8, "seed": 9, "ignore_eos": True}
    bodies = [body | ({"messages": CHAT} if chat else {"prompt": "abc abc ab"}) | {"n": 3}]
    if not chat:
        bodies.append(body | {"prompt": [[ord(c) - 32 for c in q] for q in ("abc abc ab", "xyz xy")], "n": 2})
    for b in bodies:
        whole = httpx.post(f"{server.url}/v1/{path}", json=b, timeout=TIMEOUT).json()
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        events = _sse_events(httpx.post(f"{server.url}/v1/{path}", json=b | opts, timeout=TIMEOUT))
        texts = [c["message"]["content"] if chat else c["text"] for c in whole["choices"]]
        assert _by_index(events, chat) == dict(enumerate(texts))
        finished = [ch["index"] for ev in events for ch in ev["choices"] if ch["finish_reason"]]
        assert sorted(finished) == list(range(len(texts)))
        assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
        if chat:  # each choice opens with its role
            roles = [ch["index"] for ev in events for ch in ev["choices"] if ch["delta"].get("role")]
            assert sorted(roles) == list(range(len(texts)))


def test_a_broken_choice_stream_ends_the_merged_stream_with_an_error(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If one choice's event stream raises, the merged stream reports a server error in-band and ends, instead of
    waiting for that choice forever; the other jobs are freed."""
    from treedraft.server.app import OpenAIServer

    real = OpenAIServer.choice_events

    async def flaky(self, job, item, p, index, chat):
        async for ev in real(self, job, item, p, index, chat):
            if index == 1:
                raise RuntimeError("boom")
            yield ev

    monkeypatch.setattr(OpenAIServer, "choice_events", flaky)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 50, "temperature": 0, "ignore_eos": True, "n": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    errors = [e for e in _sse_events(r) if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error"
    wait_for(lambda: metric(scrape(server.url), "treedraft:num_requests_running") == 0, "the jobs to leave", 30)


def test_n_choices_are_independent_seeded_draws(server: LiveServer) -> None:
    """n = 3: three choices decoded together; a seeded request's choice i is the n = 1 request with seed
    choice_seed(seed, i) (choice 0: the seed itself)."""
    url = f"{server.url}/v1/completions"
    body = {"model": "tiny", "prompt": "abc abc ab", "max_tokens": 6, "temperature": 1.5, "ignore_eos": True}
    out = httpx.post(url, json=body | {"n": 3, "seed": 11, "logprobs": 1}, timeout=TIMEOUT).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 18
    for i, c in enumerate(out["choices"]):
        seed = choice_seed(11, i)
        one = httpx.post(url, json=body | {"seed": seed, "logprobs": 1}, timeout=TIMEOUT).json()["choices"][0]
        assert c["text"] == one["text"] and c["logprobs"]["tokens"] == one["logprobs"]["tokens"], i
        # batched with the other choices: this tiny model's Python rows round differently (the native ones would not)
        assert all(
            abs(a - b) < 1e-4 for a, b in zip(c["logprobs"]["token_logprobs"], one["logprobs"]["token_logprobs"])
        )
    assert len({c["text"] for c in out["choices"]}) > 1  # not one draw three times
    greedy = httpx.post(url, json=body | {"n": 2, "temperature": 0}, timeout=TIMEOUT).json()["choices"]
    assert greedy[0]["text"] == greedy[1]["text"]


def test_choice_seeds_of_neighbouring_requests_do_not_overlap() -> None:
    """Seeds 0..199 with n = 16 each: 3,200 distinct choice seeds (seed + i shared 15 of 16 with the next request),
    choice 0 the request's own seed, and every one a valid 64-bit seed."""
    seeds = [choice_seed(s, i) for s in range(200) for i in range(16)]
    assert len(set(seeds)) == len(seeds)
    assert [choice_seed(s, 0) for s in (0, 7, 2**64 - 1)] == [0, 7, 2**64 - 1]
    assert all(0 <= x < 2**64 for x in seeds)


# a request that would run long: its client leaves first
LONG = {
    "model": "tiny",
    "messages": CHAT,
    "max_tokens": 4000,
    "temperature": 0,
    "ignore_eos": True,
    "treedraft": {"drafter": "none"},
}


def _abandoned(server: LiveServer, before: dict, n: int, what: str, timeout: float) -> float:
    """After a client left a LONG request: wait for its n jobs to leave the worker, check they count as aborted;
    the tokens they generated."""
    wait_for(lambda: metric(scrape(server.url), "treedraft:num_requests_running") == 0, what, timeout)
    after = scrape(server.url)
    assert metric(after, "treedraft:request_aborted_total") - metric(before, "treedraft:request_aborted_total") == n
    return metric(after, "treedraft:generation_tokens_total") - metric(before, "treedraft:generation_tokens_total")


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_leaving_mid_stream_frees_its_slot(server: LiveServer, n: int) -> None:
    """A stream abandoned after 3 pieces: its job (every choice's, n = 2) leaves the worker, counted as aborted."""
    before = scrape(server.url)
    body = {**LONG, "stream": True, "n": n}
    with httpx.Client(timeout=TIMEOUT) as c, c.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: closing this generator would close the connection
        got = 0
        for line in lines:
            got += line.startswith('data: {"id"') and '"content": "' in line and '"content": ""' not in line
            if got >= 3:
                break
        assert got == 3
        assert metric(scrape(server.url), "treedraft:num_requests_running") == n
    gen = _abandoned(server, before, n, "the abandoned stream to leave the worker", 30)
    assert 3 <= gen < 4000 * n, gen
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=TIMEOUT
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 * n


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_leaving_a_non_streamed_request_frees_its_slot(llm: LLM, n: int) -> None:
    """A non-streamed request whose client gives up while tokens keep coming (the handler is never idle for a
    whole poll interval, the default 0.25 s here): its jobs leave the worker at once, counted as aborted, instead
    of running to max_tokens."""
    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.25))) as server:
        _leave_a_non_streamed_request(server, n)


def _leave_a_non_streamed_request(server: LiveServer, n: int) -> None:
    before = scrape(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json={**LONG, "n": n}, timeout=httpx.Timeout(TIMEOUT, read=1.0))
    gen = _abandoned(server, before, n, "the abandoned request to leave the worker", 10)
    assert 0 < gen < 4000 * n, gen


# ----------------------------------------------------------------------------- loadtest


@pytest.mark.parametrize(
    "url,base",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.9.8.7:1/", "http://127.9.8.7:1"),
        ("http://localhost:8000/v1", "http://localhost:8000"),
        ("http://[::1]:8080", "http://[::1]:8080"),
        ("https://LOCALHOST", "https://localhost"),
    ],
)
def test_loopback_urls_are_accepted(url: str, base: str) -> None:
    assert loadtest.check_loopback(url) == base


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:8000",
        "http://192.168.1.10",
        "http://172.16.0.1:80",
        "http://8.8.8.8",
        "http://example.com:8000",
        "http://127.0.0.1.nip.io:8000",
        "http://localhost.example.org",
        "http://[::2]:80",
        "http://0.0.0.0:8000",
        "http://[::ffff:10.0.0.1]:80",
        "http://2130706433:80",
        "ftp://127.0.0.1",
        "127.0.0.1:8000",
    ],
)
def test_loadtest_refuses_other_hosts_before_any_connection(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def no_client(*a, **k):
        raise AssertionError("a client was created for a refused URL")

    monkeypatch.setattr(httpx, "AsyncClient", no_client)
    monkeypatch.setattr(httpx, "Client", no_client)
    with pytest.raises(loadtest.LoadTestError):
        loadtest.check_loopback(url)
    assert main(["loadtest", "--url", url, "--requests", "1", "--concurrency", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and ("only servers on this machine" in err or "http://" in err), err


def test_loadtest_summary_arithmetic() -> None:
    R = loadtest.RequestResult
    rs = [
        R(True, ttft=0.1, e2e=1.1, completion_tokens=11, gaps=[0.1] * 10),
        R(True, ttft=0.3, e2e=0.3, completion_tokens=1),
        R(False, error="http 429"),
        R(False, error="http 429"),
    ]
    lv = loadtest.summarize(2, rs, wall_s=2.0)
    assert (lv.requests, lv.completed, lv.errors, lv.error_kinds) == (4, 2, 2, {"http 429": 2})
    assert lv.output_tokens == 12 and lv.tokens_per_s == 6.0 and lv.requests_per_s == 1.0
    assert lv.latency["ttft_p50"] == pytest.approx(0.2) and lv.latency["ttft_p99"] == pytest.approx(0.298)
    assert lv.latency["tpot_p50"] == pytest.approx(0.1)  # (1.1 - 0.1) / 10; one token has no TPOT
    assert lv.latency["itl_p99"] == pytest.approx(0.1)
    empty = loadtest.summarize(1, [R(False, error="timeout")], wall_s=1.0)
    assert empty.tokens_per_s == 0 and empty.latency["ttft_p50"] is None


def test_loadtest_end_to_end_on_the_tiny_server(key_server: LiveServer, tmp_path, capsys) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"abc {i} abc {i}"}) + "\n" for i in range(3)))
    before = scrape(key_server.url)
    out = tmp_path / "out"
    argv = [
        "loadtest",
        "--url",
        key_server.url,
        "--concurrency",
        "1,3",
        "--requests",
        "4",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--prompts",
        str(prompts),
        "--warmup",
        "0",
        "--out",
        str(out),
    ]
    assert main([*argv, "--api-key", KEYS[0]]) == 0
    res = json.loads((out / "loadtest.json").read_text())
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 3] and res["model"] == "tiny"
    for lv in res["levels"]:
        assert (lv["completed"], lv["errors"], lv["output_tokens"]) == (4, 0, 24), lv
        assert lv["tokens_per_s"] > 0 and lv["latency"]["ttft_p99"] >= lv["latency"]["ttft_p50"] > 0
        assert lv["latency"]["itl_p50"] is not None
        assert 0 < lv["client_cpu_s"] < 60  # the client's own CPU time during the level is reported
    assert res["config"]["api_key"] is True and KEYS[0] not in (out / "loadtest.json").read_text()
    after = scrape(key_server.url)
    assert (
        metric(after, "treedraft:generation_tokens_total") - metric(before, "treedraft:generation_tokens_total") == 48
    )  # what the server counted equals what the client reported
    md = (out / "report.md").read_text()
    assert md.count("\n| 1 |") == 1 and md.count("\n| 3 |") == 1
    assert "| client CPU |" in md and re.search(r"\n\| 3 \|.*\| \d+% \| 0/4 \|", md)
    assert (out / "loadtest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| concurrency |" in capsys.readouterr().out
    # a wrong key: the model lookup fails with a hint; with --model given, every request is an error
    assert main([*argv, "--api-key", "wrong"]) == 2
    assert "--api-key" in capsys.readouterr().err
    assert main([*argv, "--api-key", "wrong", "--model", "tiny", "--concurrency", "2"]) == 1
    lv = json.loads((out / "loadtest.json").read_text())["levels"][0]
    assert (lv["completed"], lv["errors"], lv["error_kinds"]) == (0, 4, {"http 401": 4})
    # a request the server refuses: its message, at the warm-up, instead of levels of errors
    assert main([*argv, "--api-key", KEYS[0], "--drafter", "bogus", "--warmup", "1"]) == 2
    assert "the warm-up request was refused (http 400): unknown drafter 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("repeat", [False, True])
def test_loadtest_levels_send_their_own_prompts(monkeypatch: pytest.MonkeyPatch, repeat: bool) -> None:
    """By default no level resends a prompt an earlier level (or the warm-up) sent: a server with a prefix
    cache or a suffix index of earlier outputs would answer the repeats faster and inflate the later level;
    --repeat-prompts keeps the repeated-work load. Prompts running out is said, not hidden."""
    sent: list[tuple[str, int | None]] = []

    async def fake_stream(client, url, body, headers):
        sent.append((body["messages"][0]["content"], body.get("seed")))
        return loadtest.RequestResult(ok=True, ttft=0.01, e2e=0.02, completion_tokens=2, gaps=[0.01])

    monkeypatch.setattr(loadtest, "stream_one", fake_stream)
    cfg = loadtest.LoadTestConfig(
        url="http://127.0.0.1:9",
        concurrency=[1, 3],
        requests=3,
        max_tokens=2,
        prompts=[f"p{i}" for i in range(7)],
        model="tiny",
        seed=100,
        warmup=1,
        repeat_prompts=repeat,
    )
    said: list[str] = []
    res = asyncio.run(loadtest.run_loadtest(cfg, log=said.append))
    got = [p for p, _ in sent]
    if repeat:
        assert got[0] == "p0" and sorted(got[1:4]) == sorted(got[4:]) == ["p0", "p1", "p2"]
        assert res["config"]["level_starts"] == [0, 0]
    else:
        assert got[0] == "p0" and sorted(got[1:4]) == ["p1", "p2", "p3"] and sorted(got[4:]) == ["p4", "p5", "p6"]
        assert res["config"]["level_starts"] == [1, 4]
        assert sorted(s for _, s in sent) == list(range(100, 107))  # each request its own seed too
    assert not [m for m in said if "prompts repeat" in m]
    sent.clear()
    cfg.requests = 4  # 1 + 2 x 4 = 9 requests for 7 prompts
    asyncio.run(loadtest.run_loadtest(cfg, log=said.append))
    assert bool([m for m in said if "prompts repeat from request 8" in m]) != repeat


def test_loadtest_time_limit_cancels_what_is_left(server: LiveServer) -> None:
    cfg = loadtest.LoadTestConfig(
        url=server.url,
        concurrency=[2],
        requests=6,
        max_tokens=3000,
        prompts=["abc"],
        ignore_eos=True,
        max_seconds=1.0,
        warmup=0,
        model="tiny",
    )
    res = asyncio.run(loadtest.run_loadtest(cfg, log=lambda m: None))
    lv = res["levels"][0]
    assert lv["completed"] == 0 and lv["errors"] == 6 and lv["wall_s"] < 30
    assert list(lv["error_kinds"]) == ["unfinished after --max-seconds 1"]
    wait_for(
        lambda: (
            metric(scrape(server.url), "treedraft:num_requests_running") == 0
            and metric(scrape(server.url), "treedraft:num_requests_waiting") == 0
        ),
        "the cancelled load-test requests to leave the server",
        60,
    )


# ----------------------------------------------------------------------------- suffix drafter tenancy
@pytest.mark.parametrize("share", [False, True])
def test_suffix_drafts_stay_within_a_tenant_unless_shared(share: bool) -> None:
    from treedraft.drafters.suffix import open_suffix_store

    llm = tiny_llm()
    llm = LLM(llm.engine, llm.tokenizer, "tiny", "cpu", heads=None, suffix_store=open_suffix_store(share=share))
    body = {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
        "treedraft": {"drafter": "suffix"},
    }

    def accepted(key: str) -> tuple[int, str]:
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=bearer(key), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["treedraft"]["accepted_tokens"], out["choices"][0]["text"]

    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.05, api_keys=KEYS))) as s:
        cold, text = accepted(KEYS[0])
        warm, text_warm = accepted(KEYS[0])  # key A again: its first answer is in its index now
        other, text_other = accepted(KEYS[1])  # key B: a cold index of its own, unless the operator shares
    assert text == text_warm == text_other  # drafts never change the greedy output
    # nearly the whole 48-token answer comes from A's first pass (cold drafts come from the request's own
    # index: the tiny model loops, so the cold pass gets ~30 already)
    assert warm >= 42 and warm >= cold + 10, (cold, warm)
    assert other == (warm if share else cold), (cold, warm, other)
    assert {r.tenant for r in llm.suffix_store.records()} == {tenant_id(KEYS[0]), tenant_id(KEYS[1])}


def test_suffix_bound_is_per_tenant_in_the_server() -> None:
    """--suffix-max-tokens bounds each tenant: key B's request does not evict key A's, A's own traffic does."""
    from treedraft.drafters.suffix import open_suffix_store

    llm = tiny_llm()
    store = open_suffix_store(max_tokens=100)  # one request is ~50 tokens (prompt tail + 48 new): two fit, three don't
    llm = LLM(llm.engine, llm.tokenizer, "tiny", "cpu", heads=None, suffix_store=store)

    def run(key: str, prompt: str) -> int:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "treedraft": {"drafter": "suffix"},
        }
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=bearer(key), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["treedraft"]["accepted_tokens"]

    a, b = tenant_id(KEYS[0]), tenant_id(KEYS[1])
    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.05, api_keys=KEYS))) as s:
        cold = run(KEYS[0], "The quick brown fox")
        assert 0 < store.tenant_tokens(a) <= 100 and len(store.records(a)) == 1
        assert "fox" in llm.tokenizer.decode(list(store.records(a)[0].tokens))  # the prompt's tail is recorded
        run(KEYS[1], "Lorem ipsum dolor")
        run(KEYS[1], "A completely different start")  # B goes over the bound: only B's oldest is evicted
        assert len(store.records(a)) == 1 and store.tenant_tokens(b) <= 100
        assert store.num_tokens > 100  # the bound is per tenant, not global
        warm = run(KEYS[0], "The quick brown fox")  # A's first answer is still indexed
        assert warm >= 42 and warm >= cold + 10, (cold, warm)  # as in the tenancy test above
        for prompt in ("Pack my box", "Sphinx of black quartz", "How vexingly quick"):
            run(KEYS[0], prompt)  # A's own traffic evicts A's oldest requests
            assert store.tenant_tokens(a) <= 100
        assert all("fox" not in llm.tokenizer.decode(list(r.tokens)) for r in store.records(a))
    assert len(store.records(b)) >= 1 and store.tenant_tokens(b) <= 100


def test_loadtest_raw_client_parses_chunked_and_plain_event_streams() -> None:
    """The lean client behind `treedraft loadtest` for http:// servers: events split across chunks (and an event
    split mid-line), a body without chunked framing, a non-200 answer and a stream cut before [DONE]."""

    def serve(status: bytes, body: bytes, chunked: bool, cut: int = 0):
        async def handler(reader, writer):
            head = b""
            while b"\r\n\r\n" not in head:
                head += await reader.read(1024)
            assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and b"Host: 127.0.0.1:" in head
            extra = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % len(body)
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/event-stream\r\n" + extra + b"\r\n")
            if chunked:
                parts = [body[i : i + 7] for i in range(0, len(body), 7)]
                writer.write(b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts))
                writer.write(b"" if cut else b"0\r\n\r\n")
            else:
                writer.write(body)
            await writer.drain()
            writer.close()

        return handler

    def chunk(text: str) -> str:
        return json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})

    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 2}})
    stream = f"data: {chunk('he')}\n\ndata: {chunk('llo')}\n\ndata: {usage}\n\ndata: [DONE]\n\n".encode()

    async def one(status: bytes, body: bytes, chunked: bool, cut: int = 0) -> loadtest.RequestResult:
        srv = await asyncio.start_server(serve(status, body, chunked, cut), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        try:
            client = loadtest.RawStreamClient(url, 10.0)
            return await loadtest.stream_one(client, f"{url}/v1/chat/completions", {"x": 1}, {"Authorization": "B"})
        finally:
            srv.close()

    for chunked in (True, False):
        r = asyncio.run(one(b"200 OK", stream, chunked))
        assert r.ok and r.error is None and r.completion_tokens == 2 and len(r.gaps) == 1 and r.ttft is not None
    bad = asyncio.run(one(b"429 Too Many Requests", b'{"error": {}}', False))
    assert not bad.ok and bad.error == "http 429" and bad.detail == '{"error": {}}'
    refused = b'{"error": {"message": "unknown drafter \'bogus\'", "type": "invalid_request_error"}}'
    bad = asyncio.run(one(b"400 Bad Request", refused, False))  # what the server said reaches the user
    assert (bad.error, bad.detail) == ("http 400", "unknown drafter 'bogus'")
    cut = asyncio.run(one(b"200 OK", stream[:40], True, cut=1))
    assert not cut.ok and cut.error == "stream ended without [DONE]"
    # legal SSE framings of other servers (a review, session 44: each made every request an error): CRLF line ends
    # (sse-starlette's default, llama-cpp-python's server), "data:" without the space; the chunks (7 bytes) split CRLFs
    for framed in (stream.replace(b"\n", b"\r\n"), stream.replace(b"data: ", b"data:")):
        for chunked in (True, False):
            r = asyncio.run(one(b"200 OK", framed, chunked))
            assert r.ok and r.completion_tokens == 2 and len(r.gaps) == 1, (framed[:30], chunked, r.error)
    bad = asyncio.run(one(b"500 Internal Server Error", b'{"error": {"message": "model overloaded"}}', True))
    assert bad.detail == "model overloaded"  # a chunked error body: its chunk sizes were part of the detail


def test_loadtest_without_a_server_says_so(capsys: pytest.CaptureFixture) -> None:
    """A free loopback port: a clear error naming the URL and how to start a server (was a ConnectError traceback)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert main(["loadtest", "--url", url, "--requests", "1", "--concurrency", "1", "--max-seconds", "30"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no server answers at " + url) and "treedraft serve" in err, err
    base = ["loadtest", "--url", url, "--requests", "1", "--concurrency", "1"]
    assert main([*base, "--warmup", "-1"]) == 2  # (it started the first level at the last prompt)
    assert "--warmup must be >= 0" in capsys.readouterr().err


def test_loadtest_out_as_a_file_is_refused_before_the_run(capsys: pytest.CaptureFixture, tmp_path) -> None:
    """--out naming a file failed after the whole load test, its results lost; now before any request."""
    f = tmp_path / "afile"
    f.write_text("x")
    for out in (f, f / "sub"):  # a file, or a file on the way
        assert main(["loadtest", "--url", "http://127.0.0.1:9", "--requests", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and "cannot make that directory" in err and "no server answers" not in err
    fresh = tmp_path / "new"  # a run that fails (no server) leaves no empty folder behind
    assert main(["loadtest", "--url", "http://127.0.0.1:9", "--requests", "1", "--out", str(fresh)]) == 2
    assert "no server answers" in capsys.readouterr().err and not fresh.exists()


def test_what_counts_as_a_large_request() -> None:
    """Every part of a request that is tokenized or compiled counts toward its size: message text, an assistant's
    earlier tool-call arguments, completion prompts, the predicted output, tools and the response format."""
    from treedraft.server.app import OpenAIServer as Server
    from treedraft.server.protocol import ChatCompletionRequest, CompletionRequest

    srv = Server.__new__(Server)  # pool_for reads the two pools only
    srv.tok_pool, srv.large_pool = "small", "large"
    big = "x" * (Server.LARGE_INPUT_CHARS + 1)
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": big}}]}
    user = {"role": "user", "content": "hi"}
    for fields, want in (
        ({"messages": [user]}, "small"),
        ({"messages": [{"role": "user", "content": big}]}, "large"),
        ({"messages": [user, call, {"role": "tool", "content": "1"}]}, "large"),
        ({"messages": [user], "prediction": {"type": "content", "content": big}}, "large"),
        ({"messages": [user], "response_format": {"type": "json_object", "x": big}}, "large"),
    ):
        assert srv.pool_for(ChatCompletionRequest.model_validate(fields)) == want, fields
    assert srv.pool_for(CompletionRequest.model_validate({"prompt": ["a", big]})) == "large"
    assert srv.pool_for(CompletionRequest.model_validate({"prompt": [1, 2, 3]})) == "small"


def test_a_large_prompt_being_tokenized_does_not_hold_up_small_requests(server: LiveServer) -> None:
    """A request of megabytes of text takes seconds to tokenize; other requests' tokenizing runs beside it, not after
    it (a review saw a 4-token request wait 13 s behind three 8 MB prompts). Here the large request's tokenizing
    is held until the small one has been answered."""
    import threading

    srv = server.app.state.treedraft
    release, entered = threading.Event(), threading.Event()
    encode = srv.encode

    def slow_encode(req, *a):
        if sum(len(m.text()) for m in req.messages) > 5000:
            entered.set()
            assert release.wait(60), "never released"
        return encode(req, *a)

    srv.encode, srv.LARGE_INPUT_CHARS = slow_encode, 5000
    url = f"{server.url}/v1/chat/completions"
    big = {"model": "tiny", "messages": [{"role": "user", "content": "ab " * 3000}], "max_tokens": 2}
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(httpx.post(url, json=big, timeout=TIMEOUT)))
    try:
        t.start()
        assert entered.wait(30)
        small = httpx.post(url, json={"model": "tiny", "messages": CHAT, "max_tokens": 2}, timeout=10.0)
        assert small.status_code == 200 and not out  # answered while the large one is still tokenizing
    finally:
        release.set()
        t.join(60)
        del srv.encode, srv.LARGE_INPUT_CHARS
    assert out and out[0].status_code < 500, out


def test_a_shutdown_answers_unfinished_requests_with_a_503(llm: LLM, monkeypatch) -> None:
    """When a shutdown's grace period runs out, requests still decoding or waiting get a 503 ``server_shutting_down``
    error (JSON, or an error event closing the stream) instead of a cut connection or uvicorn's plain-text 500, at
    once even while the worker is inside a long step, and later ones too; they count as failures, not aborts. The
    serve command's uvicorn server calls the drain as its shutdown begins, before the app's own shutdown."""
    import threading
    from types import SimpleNamespace

    import uvicorn

    import treedraft.server.cli as serve_cli
    from treedraft.server.cli import draining_server, run_server

    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.05, max_batch=2))) as s:
        srv = s.app.state.treedraft
        step, gate = srv.worker._step, threading.Event()
        gate.set()
        srv.worker._step = lambda: (gate.wait(60), time.sleep(0.02), step())[2]  # slow steps; a closed gate: a long one
        url = f"{s.url}/v1/chat/completions"
        body = {"model": "tiny", "messages": CHAT, "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
        before = scrape(s.url)
        out: list[httpx.Response] = []
        posts = [threading.Thread(target=lambda: out.append(httpx.post(url, json=body, timeout=TIMEOUT)))]
        posts.append(threading.Thread(target=lambda: out.append(httpx.post(url, json=body, timeout=TIMEOUT))))
        posts[0].start()
        events = []
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:  # two running (the batch), one waiting; then the worker's step hangs
                        posts[1].start()
                        wait_for(lambda: len(srv.worker.queue) == 1, "the third request to wait", 30)
                        gate.clear()
                        srv.drain(0.0)
        for t in posts:
            t.join(30)
        assert len(out) == 2 and not gate.is_set()  # all answered while the worker was still inside its step
        gate.set()
        for r in out:
            assert_error(r, 503)
            assert r.json()["error"]["code"] == "server_shutting_down"
        assert "error" in events[-1] and events[-1]["error"]["code"] == "server_shutting_down", events[-1]
        assert len(events) < 100  # cut well before max_tokens
        assert_error(httpx.post(url, json=body | {"max_tokens": 2}, timeout=TIMEOUT), 503)  # still shutting down
        wait_for(lambda: not srv.worker.running, "the worker to drop the failed jobs", 30)
        after = scrape(s.url)
        aborted = metric(after, "treedraft:request_aborted_total") - metric(before, "treedraft:request_aborted_total")
        failed = metric(after, "treedraft:request_errors_total", status="503")
        assert aborted == 0 and failed == 4 - metric(before, "treedraft:request_errors_total", status="503")

    order: list[str] = []

    async def app(scope, receive, send) -> None:  # lifespan only: records when the app's shutdown comes
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                order.append("app shutdown")
                await send({"type": "lifespan.shutdown.complete"})
                return

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = draining_server(uvicorn.Config(app, log_level="warning", lifespan="on"), lambda: order.append("drain"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    wait_for(lambda: server.started, "uvicorn to start", 30)
    assert not order
    server.should_exit = True
    th.join(30)
    assert order == ["drain", "app shutdown"]
    # run_server: uvicorn's grace period is --shutdown-timeout, the app drains 1 s before it ends
    made: dict = {}
    fake_server = SimpleNamespace(run=lambda: None)
    monkeypatch.setattr(
        serve_cli, "draining_server", lambda cfg, drain: made.update(cfg=cfg, drain=drain) or fake_server
    )
    drains: list[float] = []
    fake = SimpleNamespace(state=SimpleNamespace(treedraft=SimpleNamespace(drain=drains.append)))
    run_server(fake, "127.0.0.1", 0, "warning", 7.0)
    assert made["cfg"].timeout_graceful_shutdown == 7.0 and made["cfg"].host == "127.0.0.1"
    made["drain"]()
    assert drains == [6.0]


def test_requests_that_would_be_answered_wrongly_or_slowly_are_400s(server: LiveServer, llm: LLM) -> None:
    """A review (session 44): vLLM's extras that change the answer were ignored (200 with unconstrained text); an
    invalid max_tokens passed beside max_completion_tokens; 60,000 stop strings slowed every other request 5.6x; a
    prediction of 800 KB held the event loop for seconds. Each is now a 400 naming its field; nulls are defaults."""
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2, "temperature": 0}
    for extra, param in (
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"bad_words": ["abc"]}, "bad_words"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"max_tokens": -7, "max_completion_tokens": 3}, "max_tokens"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"prediction": {"type": "content", "content": "abc " * llm.model.max_seq_len}}, "prediction"),
    ):
        err = assert_error(httpx.post(url, json=body | extra, timeout=TIMEOUT), 400, param)
        assert err["message"]
    ok = body | {
        "stop": [f"s{i}" for i in range(64)],
        "include_stop_str_in_output": None,  # null: not asked for
        "messages": [
            {"role": "user", "content": "abc", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": None, "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "user", "content": "abc"},
        ],
    }
    r = httpx.post(url, json=ok, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    streamed = body | {"stream": True, "stream_options": {"include_usage": None}}
    r = httpx.post(url, json=streamed, timeout=TIMEOUT)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert '"usage"' not in r.text  # null: the default, no usage chunk


def test_a_message_name_reaches_the_chat_template() -> None:
    from treedraft.server.protocol import ChatMessage

    assert ChatMessage(role="user", content="hi", name="ann").as_dict() == {
        "role": "user",
        "content": "hi",
        "name": "ann",
    }
    assert "name" not in ChatMessage(role="user", content="hi").as_dict()


def test_ray_serves_key_value_arguments_give_the_serve_flags_on_off_ones_included() -> None:
    """A review (session 44): native_prefill=false became `--native-prefill false` (an argparse error): on/off flags
    take true / false; store_true switches key=true; api_key comma-separated (no Ray needed: the argv alone)."""
    from treedraft.cli import build_parser
    from treedraft.server.cli import serve_argv

    argv = serve_argv({"model": "m", "native_prefill": "false", "suffix_share": "true", "api-key": "k1,k2"})
    a = build_parser().parse_args(argv)
    assert a.native_prefill is False and a.suffix_share and a.api_key == ["k1", "k2"] and a.model == "m"
    assert build_parser().parse_args(serve_argv({"native_prefill": "true"})).native_prefill is True
    assert build_parser().parse_args(serve_argv({"protect_health_metrics": "no"})).protect_health_metrics is False
    with pytest.raises(ValueError, match="native_prefill=true or native_prefill=false"):
        serve_argv({"native_prefill": "maybe"})


def test_an_error_in_one_jobs_text_fails_that_job_alone_and_frees_its_slot(llm: LLM, monkeypatch) -> None:
    """A review (session 44): an exception while turning one job's tokens into text dropped the rest of the step's
    events; a job whose request finished in that step would then stay in the batch for ever (never planned again)."""
    import concurrent.futures

    from treedraft import text as text_mod

    real = text_mod.TextStream.feed

    def feed(self, new):
        if "QQQ" in self.stopper.stops:  # the marked request's text fails
            raise RuntimeError("text failed")
        return real(self, new)

    monkeypatch.setattr(text_mod.TextStream, "feed", feed)
    with LiveServer(create_app(llm, ServerSettings(poll_interval_s=0.05, max_batch=4))) as s:
        url = f"{s.url}/v1/completions"

        def post(stop):
            body = {"model": "tiny", "prompt": "abc abc", "max_tokens": 3, "temperature": 0, "stop": stop}
            return httpx.post(url, json=body, timeout=TIMEOUT).status_code

        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            codes = list(ex.map(post, [["QQQ"], ["zzz"], ["yyy"]]))
        assert codes == [500, 200, 200]
        worker = s.app.state.treedraft.worker
        wait_for(lambda: not worker.running, "every slot free again", 10)
        assert post(["zzz"]) == 200
