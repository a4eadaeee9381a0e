"""64 concurrent streaming clients against a batching server on a tiny model (loopback, fast).

Mixed greedy and seeded sampling, some with stop strings, a few disconnecting mid-stream: every
completed stream equals the request's solo output (tiny model with native row-invariant linears; the
drafter keeps a suffix index shared across requests, so trees differ between solo and batched runs),
the disconnects free their slots (metrics), batches really form, /health stays OK.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import torch  # noqa: E402
from server_utils import CharTokenizer, LiveServer, metric, scrape, wait_for  # noqa: E402
from spec_stats import one_thread  # noqa: E402, F401

from treedraft import kernels  # noqa: E402
from treedraft.api import LLM  # noqa: E402
from treedraft.drafters.hybrid import HybridDrafter  # noqa: E402
from treedraft.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from treedraft.drafters.suffix import make_suffix_drafter  # noqa: E402
from treedraft.engine import Engine, GenerationStats  # noqa: E402
from treedraft.models.tiny import tiny_llama  # noqa: E402
from treedraft.scheduler import run_alone  # noqa: E402
from treedraft.server import ServerSettings, create_app  # noqa: E402
from treedraft.server.worker import GIL_SWITCH_INTERVAL_S  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable (exactness needs them)"),
]

STEP_ROWS, CHUNK, MAX_BATCH = 24, 16, 16
N_CLIENTS = 64


def native_tiny_llm() -> LLM:
    """The tiny served model (char tokenizer) with native q4 linears (row-invariant) and the default drafter's
    kind: prompt lookup + a suffix index shared by every request (no Medusa heads for a tiny model). The index
    learns from each finished request (the solo runs included), so batched trees differ from the solo ones;
    greedy and seeded text must not."""
    from native_utils import make_native

    tok = CharTokenizer()
    model = make_native(tiny_llama(seed=0, vocab_size=tok.vocab_size, max_seq_len=4096, scale=0.6))
    suffix = make_suffix_drafter(None, "", min_match=2)  # None: one in-memory store, shared by its tenant copies
    drafter = HybridDrafter([PromptLookupDrafter(), suffix], name="hybrid-suffix")
    return LLM(Engine(model, drafter), tok, "tiny", "cpu", heads=None)  # type: ignore[arg-type]


def solo(llm: LLM, prompt: str, **kw) -> tuple[str, str]:
    """(text, finish_reason) of one request run alone through the same loop (same row budget, chunks)."""
    ids = llm.encode_prompt(prompt, raw=True)
    cfg = llm.config(**kw)
    eng = llm.engine
    out = run_alone(
        eng, ids, cfg, drafter=llm.get_drafter("default", heads=None), step_rows=STEP_ROWS, prefill_chunk=CHUNK
    )
    chunks = llm.text.text_stream(cfg, eng.token_budget(len(ids), cfg), GenerationStats()).feed(out)
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def _body(prompt: str, max_tokens: int, temperature: float, seed: int | None, stop: list[str] | None) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stop": stop,
        "stream": True,
    }


async def _client(url: str, body: dict, leave_after: int | None) -> tuple[str, str | None, int]:
    """Stream one completion; (text, finish_reason, chunks seen); ``leave_after`` chunks: disconnect."""
    text, finish, seen = [], None, 0
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            for ch in ev["choices"]:
                text.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
                seen += 1
            if leave_after is not None and seen >= leave_after:
                return "".join(text), None, seen  # closing the stream disconnects
    return "".join(text), finish, seen


def test_64_concurrent_streams_equal_their_solo_outputs() -> None:
    llm = native_tiny_llm()
    rng = random.Random(0)
    alphabet = "abcdefgh ijk"
    plans = []  # (body, expected (text, finish) or None, leave_after)
    for i in range(N_CLIENTS):
        prompt = "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 60)))
        max_tokens = rng.randint(8, 28)
        temperature, seed = (0.8, 1000 + i) if i % 4 == 1 else (0.0, None)
        stop = None
        if i % 4 == 2:  # a stop string taken from the middle of its own solo output (so it really stops)
            full, _ = solo(llm, prompt, max_new_tokens=max_tokens, temperature=temperature, seed=seed)
            stop = [full[5:7]] if len(full) >= 8 else None
        if i % 16 == 3:  # leaves after 3 chunks of a stream that cannot end by itself before that is noticed
            body = {**_body(prompt, 3000, temperature, seed, None), "ignore_eos": True}
            plans.append((body, None, 3))
            continue
        kw = dict(max_new_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop or [])
        plans.append((_body(prompt, max_tokens, temperature, seed, stop), solo(llm, prompt, **kw), None))
    settings = ServerSettings(
        max_batch=MAX_BATCH, max_queue=N_CLIENTS, step_rows=STEP_ROWS, prefill_chunk=CHUNK, poll_interval_s=0.02
    )
    with LiveServer(create_app(llm, settings)) as srv:
        before = scrape(srv.url)

        async def run_all():
            return await asyncio.gather(*(_client(srv.url, b, leave) for b, _, leave in plans))

        results = asyncio.run(run_all())
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        wait_for(lambda: metric(scrape(srv.url), "treedraft:num_requests_running") == 0, "the batch to drain", 30)
        after = scrape(srv.url)
    checked = {"greedy": 0, "seeded": 0, "stop": 0}
    for i, ((body, expected, leave), (text, finish, seen)) in enumerate(zip(plans, results)):
        if leave is not None:
            assert seen >= leave
            continue
        assert (text, finish) == expected, f"client {i} ({body['temperature']=}, {body['stop']=}) differs from solo"
        kind = "stop" if body["stop"] else "seeded" if body["seed"] is not None else "greedy"
        checked[kind] += 1
        if body["stop"]:
            assert finish == "stop" and body["stop"][0] not in text
    assert min(checked.values()) >= 10, checked
    leavers = sum(leave is not None for _, _, leave in plans)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("treedraft:request_aborted_total") == leavers
    done = delta("treedraft:request_success_total", finished_reason="stop") + delta(
        "treedraft:request_success_total", finished_reason="length"
    )
    assert done == N_CLIENTS - leavers
    steps, batched = delta("treedraft:batch_size_count"), delta("treedraft:batch_size_sum")
    assert batched / steps > 4, (batched, steps)  # requests really shared steps
    assert delta("treedraft:batch_size_bucket", le="16.0") == steps  # never more than max_batch
    assert delta("treedraft:spec_decode_num_accepted_tokens_total") > 0
    assert torch.get_num_threads() == 1
    # the worker shortened the GIL switch interval (the event loop must not hold the GIL for 5 ms while the
    # worker waits to accept a step's tokens)
    assert sys.getswitchinterval() <= GIL_SWITCH_INTERVAL_S


def test_serve_cli_batching_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """--max-batch / --step-rows / --prefill-chunk reach the settings; bad values are refused with a message."""

    import treedraft.cli
    import treedraft.server.cli as serve_cli
    from treedraft.cli import main

    got: dict = {}
    monkeypatch.setattr(treedraft.cli, "load_from_args", lambda a: native_tiny_llm())
    monkeypatch.setattr(serve_cli, "create_app", lambda llm, settings: got.setdefault("settings", settings))
    monkeypatch.setattr(serve_cli, "run_server", lambda *a: None)
    assert main(["serve", "--max-batch", "3", "--step-rows", "12", "--prefill-chunk", "0"]) == 0
    s = got.pop("settings")
    assert (s.max_batch, s.step_rows, s.prefill_chunk) == (3, 12, None)
    assert main(["serve"]) == 0
    s = got.pop("settings")
    assert (s.max_batch, s.step_rows, s.prefill_chunk) == (8, None, 256)
    assert main(["serve", "--max-batch", "0"]) == 2
    assert "max_batch must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--port", "99999"]) == 2 and "--port must be in 0..65535" in capsys.readouterr().err


def test_repeated_prompts_reuse_the_prefix_cache_and_keep_their_solo_text() -> None:
    """Prompts sent again (whole, or sharing a 16-token-aligned prefix) start from the server's prefix cache:
    greedy and seeded streams equal their solo runs; another tenant (``user``) reuses nothing."""
    llm = native_tiny_llm()
    rng = random.Random(3)
    bases = ["".join(rng.choice("abcdefgh ijk") for _ in range(rng.randint(40, 60))) for _ in range(3)]
    waves = [
        [(b, 0.0, None) for b in bases],
        [(bases[0], 0.0, None), (bases[1], 0.8, 5), (bases[2][:-3] + "xyz", 0.0, None), (bases[0] + "!", 0.8, 9)],
    ]
    settings = ServerSettings(max_batch=4, step_rows=STEP_ROWS, prefill_chunk=CHUNK, poll_interval_s=0.02)
    app = create_app(llm, settings)
    with LiveServer(app) as srv:
        for wave in waves:

            async def run_wave(wave=wave):
                return await asyncio.gather(*(_client(srv.url, _body(p, 12, t, s, None), None) for p, t, s in wave))

            for (p, t, s), (text, finish, _) in zip(wave, asyncio.run(run_wave())):
                assert (text, finish) == solo(llm, p, max_new_tokens=12, temperature=t, seed=s), (p, t, s)
        pc = app.state.treedraft.worker.sched.prefix_cache
        assert (pc.hits, pc.partial_hits) == (2, 2)
        other = {**_body(bases[0], 12, 0.0, None, None), "stream": False, "user": "someone-else"}
        r = httpx.post(f"{srv.url}/v1/completions", json=other, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo(llm, bases[0], max_new_tokens=12)[0]
        assert (pc.hits, pc.partial_hits) == (2, 2)  # the same prompt from another tenant: prefilled anew


def test_serve_cli_prefix_cache_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """--prefix-cache-mb reaches the settings and the scheduler's byte limit (0 = off); a negative one is refused."""

    import treedraft.cli
    import treedraft.server.cli as serve_cli
    from treedraft.cli import main
    from treedraft.server.metrics import Metrics
    from treedraft.server.worker import Worker

    got: dict = {}
    monkeypatch.setattr(treedraft.cli, "load_from_args", lambda a: native_tiny_llm())
    monkeypatch.setattr(serve_cli, "create_app", lambda llm, settings: got.setdefault("settings", settings))
    monkeypatch.setattr(serve_cli, "run_server", lambda *a: None)
    for args, mb in (([], 256), (["--prefix-cache-mb", "0"], 0), (["--prefix-cache-mb", "3"], 3)):
        assert main(["serve", "--step-rows", "8", *args]) == 0
        s = got.pop("settings")
        assert s.prefix_cache_mb == mb
        pc = Worker(native_tiny_llm(), s, Metrics("tiny"))._scheduler().prefix_cache
        assert (pc is None) if mb == 0 else (pc.max_bytes == mb << 20)
    assert main(["serve", "--prefix-cache-mb", "-1"]) == 2
    assert "prefix_cache_mb must be >= 0" in capsys.readouterr().err
