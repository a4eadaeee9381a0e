"""`treedraft loadtest`: concurrent streaming clients against an OpenAI-compatible server on this machine.

For each concurrency level C, ``--requests`` chat completions (``stream: true`` with usage) are sent
by C client tasks, each starting its next request when its previous one ends (closed loop, like
vLLM's ``benchmark_serving`` at max concurrency). Reported per level, in the style of that tool:

- throughput: completion tokens (the server's usage counts) of successful requests / wall time of the level;
- requests/s: successful requests / wall time;
- TTFT: send -> first streamed content; TPOT: (end - first content) / (completion tokens - 1), per request;
- ITL: gaps between consecutive streamed content events (tokens of one speculative step arrive together,
  so many gaps are ~0 and the tail shows the verify steps);
- errors by kind (HTTP status, in-band stream error, timeout, connection).

Bounded: ``--requests`` per level, ``--request-timeout`` per request, ``--max-seconds`` per level (what
is unfinished then is cancelled and counted as an error). Only loopback servers are accepted
(127.0.0.0/8, ``localhost``, ``::1``); proxies from the environment are ignored, so nothing leaves
this machine. Results: ``loadtest.json``, ``report.md`` and ``loadtest.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .loadtest_report import _ms, report_markdown, write_outputs

BUILTIN_PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List five uses of a paperclip.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Give me three tips for better sleep.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a Python function that reverses a string.",
)
MAX_CONCURRENCY = 1024
MAX_REQUESTS = 100_000


class LoadTestError(ValueError):
    """A load test that cannot run as asked; the message says what to change."""


def check_loopback(url: str) -> str:
    """The server's base URL (scheme://host:port, no path) if ``url`` points at this machine; else LoadTestError."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise LoadTestError(f"--url must start with http:// or https://, got {url!r}")
    host = parts.hostname
    if not host:
        raise LoadTestError(f"--url has no host: {url!r}")
    try:
        loopback = host.lower() == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: never resolved, so never contacted
        loopback = False
    if not loopback:
        raise LoadTestError(
            f"refusing to load-test {host!r}: only servers on this machine may be targeted "
            f"(127.0.0.0/8, localhost, ::1); e.g. --url http://127.0.0.1:8000"
        )
    try:
        port = parts.port
    except ValueError as e:
        raise LoadTestError(f"--url has an invalid port: {url!r} ({e})") from None
    netloc = f"[{host}]" if ":" in host else host
    path = parts.path.rstrip("/")
    if path not in ("", "/v1"):
        raise LoadTestError(f"--url should be the server root (e.g. http://127.0.0.1:8000), got path {parts.path!r}")
    return f"{parts.scheme}://{netloc}{f':{port}' if port else ''}"


def parse_concurrency(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (each 1..MAX_CONCURRENCY, in the order given)."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LoadTestError(f"--concurrency must be a comma list of integers like 1,2,4,8, got {text!r}") from None
    if not levels or any(not 1 <= c <= MAX_CONCURRENCY for c in levels):
        raise LoadTestError(f"--concurrency levels must be between 1 and {MAX_CONCURRENCY}, got {text!r}")
    return levels


def load_prompts(path: str | None) -> list[str]:
    """Prompt texts: the jsonl file given (any format treedraft reads), else MT-Bench when present, else built-ins."""
    from .prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file

    p = path or find_shared_data(MT_BENCH_FILE)
    if p is None:
        return list(BUILTIN_PROMPTS)
    return [x.text for x in read_prompt_file(p)]


@dataclass
class RequestResult:
    """One streamed request as the client saw it (times in seconds, relative to its send)."""

    ok: bool
    error: str | None = None  # kind: "http 429", "stream error", "timeout", "connection", ...
    detail: str | None = None  # an HTTP error's message from the server (its error.message, else the body's start)
    ttft: float | None = None
    e2e: float = 0.0
    completion_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between consecutive content events

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


@dataclass
class LevelResult:
    """Aggregates of one concurrency level."""

    concurrency: int
    requests: int
    completed: int
    errors: int
    error_kinds: dict[str, int]
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    requests_per_s: float
    latency: dict[str, float | None]  # {ttft,tpot,itl,e2e}_{p50,p99} in seconds
    # CPU seconds this client process spent during the level: on a machine that also runs the server, the
    # client's own per-token cost takes cores from the server (a client near 100% of a core bounds the result)
    client_cpu_s: float | None = None


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


def summarize(
    concurrency: int, results: list[RequestResult], wall_s: float, client_cpu_s: float | None = None
) -> LevelResult:
    """Throughput and latency percentiles of one level's requests."""
    good = [r for r in results if r.ok]
    kinds: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kinds[r.error or "unknown"] = kinds.get(r.error or "unknown", 0) + 1
    tokens = sum(r.completion_tokens for r in good)
    series = {
        "ttft": [r.ttft for r in good if r.ttft is not None],
        "tpot": [t for r in good if (t := r.tpot) is not None],
        "itl": [g for r in good for g in r.gaps],
        "e2e": [r.e2e for r in good],
    }
    lat = {f"{k}_{name}": _pct(v, q) for k, v in series.items() for name, q in (("p50", 50), ("p99", 99))}
    return LevelResult(
        concurrency,
        len(results),
        len(good),
        len(results) - len(good),
        kinds,
        wall_s,
        tokens,
        tokens / wall_s if wall_s > 0 else 0.0,
        len(good) / wall_s if wall_s > 0 else 0.0,
        lat,
        client_cpu_s,
    )


class _HTTPStatus(Exception):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, body: bytes = b"") -> None:
        super().__init__(status)
        self.status, self.detail = status, error_detail(body)


def error_detail(body: bytes | str) -> str | None:
    """What an error response says: OpenAI's ``error.message`` when the body is that JSON, else its first 200
    characters (None when empty)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200] or None


class RawStreamClient:
    """A lean HTTP/1.1 client for streamed completions from a plain-http server on this machine.

    On a machine shared with the server, the load generator's own CPU time per token is taken from the server:
    httpx (h11, anyio, line decoding) spent ~0.15 ms of CPU per streamed token against ~0.1 ms for the server's
    whole event loop, a tenth of the server's two cores at 8 concurrent streams. This client writes one request
    per connection (``Connection: close``) and parses the response's chunked framing and server-sent events
    itself. https, or any unexpected framing, goes through httpx instead.
    """

    def __init__(self, base_url: str, timeout: float) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.timeout = timeout

    async def events(self, path: str, body: dict, headers: dict[str, str]) -> Any:
        """Yield the ``data:`` payloads (bytes) of the response's server-sent events; _HTTPStatus on a non-200."""
        payload = json.dumps(body).encode()
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {f'[{self.host}]' if ':' in self.host else self.host}:{self.port}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(payload)}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
            await writer.drain()
            status_line = await reader.readline()
            fields = status_line.split(None, 2)
            if len(fields) < 2 or not fields[0].startswith(b"HTTP/"):
                raise ValueError(f"not an HTTP response: {status_line[:60]!r}")
            status = int(fields[1])
            chunked = False
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
            if status != 200:
                try:  # the error's JSON (what to change), for the caller's message
                    body = await asyncio.wait_for(reader.read(4096), timeout=5.0)
                except (asyncio.TimeoutError, TimeoutError, OSError):
                    body = b""
                raise _HTTPStatus(status, dechunk(body) if chunked else body)
            buf = b""
            while True:
                if chunked:
                    size_line = await reader.readline()
                    if not size_line:
                        return  # closed without the last chunk: the caller sees no [DONE]
                    size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        return
                    data = await reader.readexactly(size + 2)  # the chunk and its CRLF
                    buf += data[:-2]
                else:
                    data = await reader.read(65536)
                    if not data:
                        return
                    buf += data
                # SSE lines end in LF, CRLF or CR (sse-starlette, under llama-cpp-python's server, writes CRLF): one form
                # (a CR ending the buffer waits for the next read: it may be the first half of a CRLF)
                tail = b"\r" if buf.endswith(b"\r") else b""
                buf = buf[: len(buf) - len(tail)].replace(b"\r\n", b"\n").replace(b"\r", b"\n") + tail
                while True:
                    end = buf.find(b"\n\n")
                    if end < 0:
                        break
                    event, buf = buf[:end], buf[end + 2 :]
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):  # (the space after the colon is optional in SSE)
                            yield line[5:].removeprefix(b" ")
        finally:
            writer.close()


def dechunk(body: bytes) -> bytes:
    """The payload of a chunked HTTP body (as much of it as ``body`` holds): an error's JSON read raw kept the chunk
    sizes ('2a\\r\\n{...}\\r\\n0'), which garbled the detail shown."""
    out, rest = b"", body
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        except ValueError:
            return body  # not chunk framing after all
        if not sep or size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


async def stream_one(client: Any, url: str, body: dict, headers: dict[str, str]) -> RequestResult:
    """Send one streaming chat completion and time its events (``client``: a :class:`RawStreamClient` for
    http://, else an httpx.AsyncClient)."""
    import httpx

    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last: float | None = None
    events = 0

    def on_data(data: bytes | str) -> bool:
        """One event's payload; True at [DONE]."""
        nonlocal last, events
        if data in (b"[DONE]", "[DONE]"):
            res.ok = res.error is None
            return True
        obj = json.loads(data)
        if "error" in obj:
            res.error = "stream error"
            return False
        if obj.get("usage"):
            res.completion_tokens = int(obj["usage"]["completion_tokens"])
        for ch in obj.get("choices", ()):
            if (ch.get("delta") or {}).get("content") or ch.get("text"):
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.gaps.append(now - last)
                last = now
                events += 1
        return False

    try:
        if isinstance(client, RawStreamClient):
            await asyncio.wait_for(_stream_raw(client, urlsplit(url).path, body, headers, on_data, res), client.timeout)
        else:
            await _stream_httpx(client, url, body, headers, on_data, res)
    except (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException):
        res.error = "timeout"
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not OpenAI's chunk shape
        res.error = "invalid event"
    except (OSError, asyncio.IncompleteReadError, httpx.HTTPError) as e:  # refused, reset, cut
        res.error = f"connection: {type(e).__name__}"
    res.ok = res.ok and res.error is None
    if res.ok and not res.completion_tokens:
        res.completion_tokens = events  # a server that does not send usage: count content events
    res.e2e = time.perf_counter() - t0
    return res


async def _stream_raw(client: RawStreamClient, path: str, body: dict, headers: dict, on_data: Any, res: Any) -> None:
    try:
        async for data in client.events(path, body, headers):
            if on_data(data):
                return
    except _HTTPStatus as e:
        res.error, res.detail = f"http {e.status}", e.detail
        return
    res.error = res.error or "stream ended without [DONE]"


async def _stream_httpx(client: Any, url: str, body: dict, headers: dict, on_data: Any, res: Any) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            res.error, res.detail = f"http {r.status_code}", error_detail(await r.aread())
            return
        async for line in r.aiter_lines():  # (httpx splits on LF, CRLF and CR alike)
            if line.startswith("data:") and on_data(line[5:].removeprefix(" ")):
                return
    res.error = res.error or "stream ended without [DONE]"


@dataclass
class LoadTestConfig:
    """Everything one load test run needs."""

    url: str
    concurrency: list[int]
    requests: int
    max_tokens: int
    prompts: list[str]
    api_key: str | None = None
    model: str | None = None
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    drafter: str | None = None
    request_timeout: float = 300.0
    max_seconds: float = 600.0
    warmup: int = 1
    # False: every request of the run gets its own prompt (warm-up, then level after level), so no level
    # is answered from what an earlier one cached (prefix cache, suffix index of earlier outputs);
    # True: every level resends the same prompts (a repeated-work load)
    repeat_prompts: bool = False

    def __post_init__(self) -> None:
        self.url = check_loopback(self.url)
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise LoadTestError(f"--requests must be between 1 and {MAX_REQUESTS}, got {self.requests}")
        if self.max_tokens < 1:
            raise LoadTestError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if not self.prompts:
            raise LoadTestError("no prompts to send; give --prompts with at least one prompt")
        if self.request_timeout <= 0 or self.max_seconds <= 0:
            raise LoadTestError("--request-timeout and --max-seconds must be positive")
        if self.warmup < 0:
            raise LoadTestError(f"--warmup must be >= 0 (untimed requests before the first level), got {self.warmup}")


def _body(cfg: LoadTestConfig, model: str, i: int) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": cfg.prompts[i % len(cfg.prompts)]}],
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.seed is not None:
        body["seed"] = cfg.seed + i
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.drafter:
        body["treedraft"] = {"drafter": cfg.drafter}
    return body


def level_starts(cfg: LoadTestConfig) -> list[int]:
    """Index of each level's first request in the prompt list (request i of that level sends prompt
    start + i, modulo the list): consecutive after the warm-up, or all 0 with ``repeat_prompts``."""
    if cfg.repeat_prompts:
        return [0] * len(cfg.concurrency)
    return [cfg.warmup + k * cfg.requests for k in range(len(cfg.concurrency))]


def prompt_wrap_warning(cfg: LoadTestConfig) -> str | None:
    """The warning to print when distinct prompts run out (requests would resend earlier prompts), else None."""
    need = cfg.warmup + cfg.requests * (1 if cfg.repeat_prompts else len(cfg.concurrency))
    if need <= len(cfg.prompts):
        return None
    return (
        f"warning: {need} requests but {len(cfg.prompts)} prompts: prompts repeat from request "
        f"{len(cfg.prompts) + 1} on, and a server that caches prefills or drafts from earlier outputs answers "
        "repeats faster; give more prompts (--prompts) or fewer --requests / levels"
    )


async def _level(
    client: Any, cfg: LoadTestConfig, model: str, headers: dict[str, str], concurrency: int, start: int = 0
) -> LevelResult:
    url = f"{cfg.url}/v1/chat/completions"
    results: list[RequestResult] = []
    next_i = iter(range(start, start + cfg.requests))

    async def client_task() -> None:
        for i in next_i:  # shared iterator: each request is taken by exactly one task
            results.append(await stream_one(client, url, _body(cfg, model, i), headers))

    t0, cpu0 = time.perf_counter(), time.process_time()
    tasks = [asyncio.create_task(client_task()) for _ in range(min(concurrency, cfg.requests))]
    done, pending = await asyncio.wait(tasks, timeout=cfg.max_seconds)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for t in done:
        if t.exception() is not None:
            raise t.exception()  # a bug in this tool, not a server error
    unfinished = cfg.requests - len(results)  # cancelled mid-flight or never sent
    results += [RequestResult(ok=False, error=f"unfinished after --max-seconds {cfg.max_seconds:g}")] * unfinished
    return summarize(concurrency, results, wall, cpu)


async def run_loadtest(cfg: LoadTestConfig, log: Any = None) -> dict:
    """Run every concurrency level in order; the JSON-able result."""
    import httpx

    say = log or (lambda msg: print(msg, file=sys.stderr))
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 2, max_keepalive_connections=max(cfg.concurrency))
    timeout = httpx.Timeout(cfg.request_timeout, connect=10.0)
    # trust_env=False: no proxy from the environment may carry this traffic off the machine
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, follow_redirects=False) as client:
        model = cfg.model
        if model is None:
            try:
                r = await client.get(f"{cfg.url}/v1/models", headers=headers)
            except httpx.TransportError as e:  # refused, unreachable, timed out: no server to measure
                raise LoadTestError(
                    f"no server answers at {cfg.url} ({type(e).__name__}: {e}); start one first "
                    "(treedraft serve --host 127.0.0.1 --port PORT) and pass its --url"
                ) from None
            if r.status_code != 200:
                raise LoadTestError(
                    f"GET {cfg.url}/v1/models answered {r.status_code}: {r.text[:200]}"
                    + (" (give the server's key: --api-key or $TREEDRAFT_API_KEY)" if r.status_code == 401 else "")
                )
            model = r.json()["data"][0]["id"]
        # the streams: the lean client for http://, httpx for https://
        streamer = RawStreamClient(cfg.url, cfg.request_timeout) if cfg.url.startswith("http://") else client
        for i in range(cfg.warmup):
            w = await stream_one(streamer, f"{cfg.url}/v1/chat/completions", _body(cfg, model, i), headers)
            if not w.ok and w.detail and (w.error or "").startswith("http 4") and w.error != "http 429":  # refused
                raise LoadTestError(f"the warm-up request was refused ({w.error}): {w.detail}")  # every one would be
            if not w.ok:
                say(f"warning: warm-up request failed ({w.error}{': ' + w.detail if w.detail else ''})")
        levels = []
        wrap = prompt_wrap_warning(cfg)
        if wrap:
            say(wrap)
        for c, start in zip(cfg.concurrency, level_starts(cfg)):
            lv = await _level(streamer, cfg, model, headers, c, start)
            lat = lv.latency
            say(
                f"concurrency {c:4d}: {lv.tokens_per_s:8.1f} tok/s, {lv.requests_per_s:6.2f} req/s, "
                f"TTFT p50/p99 {_ms(lat['ttft_p50'])}/{_ms(lat['ttft_p99'])} ms, "
                f"ITL p50/p99 {_ms(lat['itl_p50'])}/{_ms(lat['itl_p99'])} ms, errors {lv.errors}/{lv.requests}"
            )
            levels.append(asdict(lv))
    return {
        "url": cfg.url,
        "model": model,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("api_key", "prompts")}
        | {"num_prompts": len(cfg.prompts), "api_key": bool(cfg.api_key), "level_starts": level_starts(cfg)},
        "levels": levels,
    }


def default_out_dir() -> Path:
    """A fresh folder under the user cache: <cache>/loadtest/<YYYYmmdd-HHMMSS>[-N]."""
    from .models.registry import cache_dir

    base = cache_dir() / "loadtest" / time.strftime("%Y%m%d-%H%M%S")
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def cmd_loadtest(a: argparse.Namespace) -> int:
    """`treedraft loadtest`: run the levels, print a summary, write the report files."""
    out = Path(a.out) if a.out else default_out_dir()
    made = not out.exists()
    try:  # made before the run, not after it (a file in the way lost the results; it also claims a default folder)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoadTestError(f"--out {out}: cannot make that directory ({e}); give another") from None
    try:
        return _run_and_write(a, out)
    except BaseException:
        if made and out.is_dir() and not any(out.iterdir()):  # a run that wrote nothing leaves nothing behind
            out.rmdir()
        raise


def _run_and_write(a: argparse.Namespace, out: Path) -> int:
    cfg = LoadTestConfig(
        url=a.url,
        concurrency=parse_concurrency(a.concurrency),
        requests=a.requests,
        max_tokens=a.max_tokens,
        prompts=load_prompts(a.prompts),
        api_key=a.api_key or os.environ.get("TREEDRAFT_API_KEY") or None,
        model=a.model,
        temperature=a.temperature,
        seed=a.seed,
        ignore_eos=a.ignore_eos,
        drafter=a.drafter,
        request_timeout=a.request_timeout,
        max_seconds=a.max_seconds,
        warmup=a.warmup,
        repeat_prompts=a.repeat_prompts,
    )
    result = asyncio.run(run_loadtest(cfg))
    paths = write_outputs(result, out)
    print(report_markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 1 if any(lv["errors"] for lv in result["levels"]) else 0


def register(subparsers: Any) -> None:
    """Add `treedraft loadtest` to the CLI."""
    p = subparsers.add_parser(
        "loadtest",
        help="load-test a treedraft (or any OpenAI-compatible) server on this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root; loopback only")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma list of concurrent clients, one level each")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--api-key", default=None, help="Bearer key (default: $TREEDRAFT_API_KEY)")
    p.add_argument(
        "--prompts",
        default=None,
        help="jsonl prompt file (prompt/turns/conversations/messages; default: MT-Bench when "
        "../shared/data has it, else built-in prompts)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: a new one under the cache: $TREEDRAFT_CACHE/loadtest, else ~/.cache/treedraft/loadtest)",
    )
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="request i gets seed + i")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (vLLM-style extra)")
    p.add_argument("--drafter", default=None, help="per-request treedraft drafter (default: the server's)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--max-seconds", type=float, default=600.0, help="time limit per level")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before the first level")
    p.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="every level resends the same prompts (default: each request its own prompt, so no level is "
        "answered from what an earlier one left in the server's prefix cache or suffix index)",
    )
    p.set_defaults(func=cmd_loadtest)
