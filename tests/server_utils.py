"""Helpers shared by the server tests: a live uvicorn on 127.0.0.1, metric scraping, a tiny served model."""

from __future__ import annotations

import functools
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence

import httpx
import uvicorn
from tokenizers import AddedToken, Tokenizer, decoders, models

from treedraft.api import LLM
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.engine import Engine
from treedraft.models.tiny import tiny_llama


class LiveServer:
    """uvicorn serving an app in a daemon thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        cfg = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn thread died during startup"
            assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not shut down within 30 s"


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(name, labels without model_name): value}; fails on a line that is not a sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert m, f"not Prometheus text format: {line!r}"
        labels = frozenset(kv for kv in re.findall(r'(\w+)="([^"]*)"', m.group(2) or "") if kv[0] != "model_name")
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset], float]:
    """GET /metrics and parse it."""
    r = httpx.get(f"{url}/metrics", timeout=10, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.text)


def metric(ms: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return ms.get((name, frozenset(labels.items())), 0.0)


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``pred`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def assert_error(r: httpx.Response, status: int | tuple[int, ...], param: str | None = "any") -> dict:
    """An OpenAI-style error body with one of ``status``; returns its "error" object."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param != "any":
        assert err["param"] == param, err
    return err


# ----------------------------------------------------------------------------- a tiny served model


class CharTokenizer:
    """One id per printable ASCII character (0..94), EOS = 95: a tokenizer the tiny model can serve."""

    vocab_size = 96
    eos_token_ids = frozenset({95})
    chat_template = "<role>content"  # is_chat: chat requests work
    hf = None
    add_bos = False

    @property
    def is_chat(self) -> bool:
        return True

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 if 32 <= ord(c) < 127 else ord("?") - 32 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i) for i in ids if 0 <= i < 95)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    @functools.cached_property
    def backend(self) -> Tokenizer:
        """The same mapping as a ``tokenizers`` backend, which the text layer streams through."""
        t = Tokenizer(models.WordLevel({chr(32 + i): i for i in range(95)} | {"<eos>": 95}, unk_token="?"))
        t.decoder = decoders.Fuse()
        t.add_special_tokens([AddedToken("<eos>", special=True)])
        return t


def tiny_llm(seed: int = 0) -> LLM:
    """A random 2-layer Llama (4096-token context, like the real model) with prompt lookup, named "tiny"."""
    tok = CharTokenizer()
    model = tiny_llama(seed=seed, vocab_size=tok.vocab_size, max_seq_len=4096, scale=2.0)
    return LLM(Engine(model, PromptLookupDrafter()), tok, "tiny", "cpu", heads=None)  # type: ignore[arg-type]
