"""The HTTP application: OpenAI routes, request preparation, responses and server-sent events.

One worker thread owns the model and decodes up to ``max_batch`` requests together (one
target forward per step, :mod:`treedraft.scheduler`); HTTP handlers validate a request on
the event loop, tokenize it on a side thread, and hand a :class:`Job` to a bounded FIFO
:class:`JobQueue`. The worker streams each job's :class:`~treedraft.text.Chunk` s back
through the event loop (``call_soon_threadsafe``), drops a job whose client went away at
the next step, and records Prometheus metrics. A full queue is answered with 429 + Retry-After.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import GenerationConfig
from ..interfaces import GenerationError
from ..logprobs import TokenLogprob
from ..text import Chunk
from ..text_grammar import choice_pattern
from ..tools import ResponseText, Tool, ToolRequestError, answer_format, answer_message, render_messages
from ..verify import RULES as _RULES
from .auth import APIKeys, AuthMiddleware
from .metrics import Metrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    ServerSettings,
    TreedraftOptions,
    chat_tools,
    parse_body,
    prediction_text,
    prompt_list,
    reject_unsupported,
    request_drafters,
    text_constraint,
)
from .responses import _JobStreamingResponse, _spec_info, _sse, _usage
from .worker import Done, Failed, Job, Worker


class ClientGone(Exception):
    """The client disconnected before its request was read whole (counted as aborted; answered 499 to nobody)."""


MAX_USER_TENANT = 128  # characters of a `user` field kept as they are in its tenant id; a longer one is hashed
# stop strings a request may give (OpenAI allows 4): each is looked for after every token on the thread that decodes
# every request, so a request with 60,000 of them made another's answer 5.6x slower (a review, session 44)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024

if TYPE_CHECKING:
    from ..api import LLM

log = logging.getLogger("treedraft.server")


@dataclass
class _Prepared:
    """A validated request ready for the worker."""

    prompt_ids: list[int]
    config: GenerationConfig
    drafter: str
    stream: bool
    include_usage: bool
    model: str
    tenant: str | None = None
    echo: str | None = None  # completions with echo: the prompt's text, put before the answer
    n: int = 1  # choices: independent jobs, decoded together in the worker's batch
    echo_lead: int = 0  # leading prompt tokens not in the echoed text (a BOS the engine put before a raw string)
    score_only: bool = False  # echo with max_tokens 0: the prompt back (scored when logprobs are asked), no tokens
    tool_mode: str | None = None  # chat with tools: the answer is a tool call or, with "auto", text (treedraft.tools)

    def choice(self, i: int) -> _Prepared:
        """The request of choice ``i``: a seeded one draws with :func:`choice_seed` (seed, i): each choice is
        reproducible, choice 0 is the n = 1 request, and no two (seed, i) pairs share a seed."""
        seed = self.config.sampling.seed
        if i == 0 or seed is None:
            return self
        sampling = replace(self.config.sampling, seed=choice_seed(seed, i))
        return replace(self, config=replace(self.config, sampling=sampling))


def _prompt_tokens(jobs: list[tuple[_Prepared, Job]]) -> int:
    """A request's prompt tokens for its usage: each prompt once, not once per choice (jobs: n per prompt)."""
    return sum(len(p.prompt_ids) for p, _ in jobs[:: jobs[0][0].n])


def choice_seed(seed: int, i: int) -> int:
    """Choice ``i``'s seed of a request seeded ``seed``: ``seed`` itself for choice 0, else splitmix64's output
    (Steele, Lea and Flood 2014) at ``seed + i`` golden-ratio increments. Seeding choice i with seed + i made
    neighbouring requests share samples (seed 5 with n = 4 and seed 6 with n = 4 had three choices in common)."""
    if i == 0:
        return seed
    m = 2**64
    z = (seed + 0x9E3779B97F4A7C15 * i) % m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
    return z ^ (z >> 31)


class _TextOffsets:
    """Completions' ``text_offset``: where each reported token starts in the choice's text, counted on the tokens'
    own bytes through an incremental UTF-8 decoder. A character split over several tokens then counts once, and
    each of its tokens starts where the character does; summing the tokens' texts decoded alone counted a U+FFFD
    per piece and drifted from the text after the first such character. Tokens the text leaves out (special
    tokens of a generated text, a BOS put before an echoed string) take no room."""

    def __init__(self, token_bytes: Callable[[int], bytes], special: Collection[int], strip: int = 0) -> None:
        self.token_bytes = token_bytes
        self.special = special
        self.strip = strip  # leading spaces the decoder drops from a text (SentencePiece's dummy prefix)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._begun: set[bool] = set()  # the parts (echoed prompt False, generated True) whose first token came
        self.at = 0

    def take(self, lps: list[TokenLogprob], lead: int = 0, generated: bool = True) -> list[int]:
        """The offsets of ``lps``, the next tokens of the text: ``lead`` first ones left out of it, and special
        tokens too where ``generated`` (the echoed prompt is decoded with them). Each part's first counted token
        loses the leading spaces its decoder strips (the generated part is decoded on its own)."""
        out = []
        for k, x in enumerate(lps):
            out.append(self.at)
            if k >= lead and not (generated and x.token_id in self.special):
                text = self._utf8.decode(self.token_bytes(x.token_id))
                if self.strip and generated not in self._begun:
                    self._begun.add(generated)
                    text = text[min(self.strip, len(text) - len(text.lstrip(" "))) :]
                self.at += len(text)
        return out


class OpenAIServer:
    """Request handling behind the routes: validation, queueing, response shaping."""

    def __init__(self, llm: LLM, settings: ServerSettings | None = None) -> None:
        self.llm = llm
        self.settings = settings = settings or ServerSettings()
        self.names = settings.served_model_names or (llm.model_name,)
        self.metrics = Metrics(self.names[0])
        self.worker = Worker(llm, settings, self.metrics)
        self.context = llm.model.max_seq_len
        self.created = int(time.time())  # /v1/models' "created": when this server loaded its model
        self.tokens_limit = min(settings.max_tokens_limit or self.context - 1, self.context - 1)
        self.tok_pool = ThreadPoolExecutor(1, "treedraft-tokenize")  # keeps tokenizing off the event loop
        # requests of more than LARGE_INPUT_CHARS characters tokenize on their own thread: a few megabytes of text take
        # seconds, and everyone else's requests would queue behind them
        self.large_pool = ThreadPoolExecutor(1, "treedraft-tokenize-large")
        self._drain_timer: threading.Timer | None = None  # a shutdown's grace period (drain)
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs
        tok = llm.tokenizer
        added = getattr(getattr(tok, "hf", None), "added_tokens_decoder", None) or {}
        # what a generated text leaves out (the detokenizer skips special tokens)
        self._special = frozenset(i for i, t in added.items() if getattr(t, "special", False)) | tok.eos_token_ids
        m = self.metrics
        m.gauge_fn(
            "treedraft:num_requests_running",
            "Requests being generated now (the batch: at most max_batch).",
            lambda: float(len(self.worker.running)),
        )
        m.gauge_fn(
            "treedraft:num_requests_waiting", "Requests waiting in the queue.", lambda: float(len(self.worker.queue))
        )
        m.gauge_fn("treedraft:max_batch_size", "Requests decoded together at most.", lambda: float(settings.max_batch))
        m.gauge_fn(
            "treedraft:max_queue_size", "Waiting requests allowed before 429.", lambda: float(settings.max_queue)
        )

    def start(self) -> None:
        """Start the worker (app startup)."""
        self.worker.start()

    def drain(self, grace_s: float) -> threading.Timer:
        """A shutdown has begun (no new connections): requests still running or queued after ``grace_s`` seconds are
        answered with a 503 error (a JSON error, or an error event in a stream) instead of a cut connection."""
        err = APIError(
            503,
            "the server is shutting down and this request did not finish in time; send it again (to another replica)",
            type_="server_error",
            code="server_shutting_down",
        )
        timer = threading.Timer(max(0.0, grace_s), self.worker.fail_all, (err,))
        timer.daemon = True
        timer.start()
        self._drain_timer = timer
        return timer

    def stop(self) -> None:
        """Stop the worker and the tokenizer thread (app shutdown)."""
        if self._drain_timer is not None:  # the shutdown ended before its grace period did
            self._drain_timer.cancel()
        self.worker.stop()
        self.tok_pool.shutdown(wait=False, cancel_futures=True)
        self.large_pool.shutdown(wait=False, cancel_futures=True)

    # -- validation

    async def read(self, request: Request, model: type[BaseModel]) -> Any:
        """The request body validated against ``model``."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refused before a byte of it is read
            raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}")
        parts, size = [], 0
        wait = self.settings.body_timeout_s
        chunks = request.stream().__aiter__()
        try:
            while True:  # counted as it arrives: a chunked upload is not buffered past the limit
                try:
                    part = await asyncio.wait_for(chunks.__anext__(), wait)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise APIError(
                        408,
                        f"the request body stalled: no bytes for {wait:g} s after {size} bytes; send it whole",
                        headers={"Connection": "close"},
                    ) from None
                size += len(part)
                if size > limit:
                    raise APIError(413, f"the request body has more than {limit} bytes; the limit is {limit}")
                parts.append(part)
        except ClientDisconnect:  # the client left while sending: an abort, not a server error (no 500, no traceback)
            self.metrics.aborted.inc()
            raise ClientGone() from None
        return parse_body(model, b"".join(parts))

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (404 when unknown)."""
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise APIError(
                404,
                f"the model {name!r} does not exist on this server; available: {', '.join(self.names)}",
                param="model",
                code="model_not_found",
            )
        return name

    def encode(self, req: CommonRequest, tools: Sequence[Tool] = (), mode: str | None = None) -> list[list[int]]:
        """Request -> each prompt's ids: one for chat; completions' several prompts (a list of strings or of
        token-id lists) in order; chat renders its ``tools`` for tool ``mode`` (runs on the tokenizer thread; user
        errors -> APIError 400)."""
        chat = isinstance(req, ChatCompletionRequest)
        try:
            if chat:
                if not req.messages:
                    raise APIError(400, "messages must contain at least one message", param="messages")
                if not any(m.text().strip() or m.tool_calls for m in req.messages):
                    raise APIError(400, "all messages are empty; give some text", param="messages")
                return [self.llm.encode_prompt(render_messages([m.as_dict() for m in req.messages], tools, mode))]
            out = []
            for k, p in enumerate(prompt_list(req.prompt)):
                if isinstance(p, list):
                    if not p:
                        several = isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], list)
                        where = f"prompt {k}" if several else "prompt"
                        raise APIError(400, f"{where} is empty; give text or token ids", param="prompt")
                    out.append(list(p))
                else:
                    out.append(self.llm.encode_prompt(p, raw=True))
            return out
        except APIError:
            raise
        except ValueError as e:  # GenerationError or tokenizer/template complaints
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        except Exception as e:
            raise APIError(
                400, f"could not tokenize the input: {type(e).__name__}: {e}", param="messages" if chat else "prompt"
            ) from None

    @staticmethod
    def tenant(request: Request, req: CommonRequest) -> str | None:
        """Who is asking: the API key's tenant id when keys are configured, else the request's ``user`` field."""
        key_tenant = getattr(request.state, "tenant", None)
        if key_tenant is not None:
            return key_tenant
        if not req.user:
            return None
        if len(req.user) <= MAX_USER_TENANT:
            return f"user-{req.user}"
        # a long field becomes a fixed-size id: the store writes the tenant id into every record, so a client's
        # megabyte `user` would otherwise cost a megabyte per request on disk (past 64 KiB it could not be written)
        return "user-sha256-" + hashlib.sha256(req.user.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    LARGE_INPUT_CHARS = 1 << 18

    def pool_for(self, req: CommonRequest) -> ThreadPoolExecutor:
        """The thread a request's tokenizing (and its grammar's build) runs on: its own for requests of more than
        :data:`LARGE_INPUT_CHARS` characters (messages with their earlier tool calls, prompts, tools, predicted
        output, response format), the shared one otherwise."""
        if isinstance(req, ChatCompletionRequest):
            n = len(str(req.tools)) if req.tools else 0
            for m in req.messages or ():  # what render_messages writes of each: its text and earlier calls
                n += len(m.text()) + sum(len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or ())
        else:
            n = sum(len(p) for p in prompt_list(req.prompt) if isinstance(p, str))
        n += len(prediction_text(req) or "") + (len(str(req.response_format)) if req.response_format else 0)
        return self.large_pool if n > self.LARGE_INPUT_CHARS else self.tok_pool

    async def prepare(self, req: CommonRequest, tenant: str | None = None) -> list[_Prepared]:
        """Validate everything that can be checked before queueing; tokenize off the event loop. One
        :class:`_Prepared` per prompt (completions may send several; chat has one)."""
        model = self.check_model(req.model)
        reject_unsupported(req)
        chat = isinstance(req, ChatCompletionRequest)
        tools, mode = chat_tools(req) if chat else ([], None)
        pname = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, pname)
        score_only = max_tokens == 0 and not chat and bool(req.echo)  # OpenAI's echo with max_tokens 0: scoring
        # both limits checked where both are given (max_completion_tokens is the one used)
        for name in dict.fromkeys((pname, "max_tokens")):
            value = getattr(req, name)
            if value is not None and value < 1 and not score_only:
                raise APIError(
                    400,
                    f"{name} must be at least 1, got {value}"
                    + ("" if chat else " (0 only with echo: the prompt back, scored with logprobs, nothing generated)"),
                    param=name,
                )
            if value is not None and value > self.tokens_limit:
                raise APIError(400, f"{name}={value} is above this server's limit of {self.tokens_limit}", param=name)
        opts = req.treedraft or TreedraftOptions()
        drafter = opts.drafter or "default"
        if drafter not in request_drafters():
            raise APIError(
                400,
                f"unknown drafter {drafter!r}; choose one of {', '.join(request_drafters())}",
                param="treedraft.drafter",
            )
        if opts.rule is not None and opts.rule not in _RULES:
            raise APIError(
                400, f"unknown acceptance rule {opts.rule!r}; choose one of {', '.join(_RULES)}", param="treedraft.rule"
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not x for x in stop):
            raise APIError(400, f"stop strings must be non-empty, got {stop!r}", param="stop")
        # every stop string is looked for after every token, on the thread that decodes every request
        if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stop):
            raise APIError(
                400,
                f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters each, got {len(stop)} "
                f"(the longest {max(map(len, stop))} characters)",
                param="stop",
            )
        pool = self.pool_for(req)
        prompts = await asyncio.get_running_loop().run_in_executor(pool, self.encode, req, tools, mode)
        predicted = prediction_text(req)
        prediction = ()
        if predicted:  # tokenized off the event loop, once for every prompt and choice
            prediction = await asyncio.get_running_loop().run_in_executor(pool, self.llm.prediction_ids, predicted)
            if len(prediction) > self.context:  # no answer can be longer (and its usage count grows with its square)
                raise APIError(
                    400,
                    f"the predicted output is {len(prediction)} tokens, longer than the model's context window of "
                    f"{self.context}; send at most that much of it",
                    param="prediction",
                )
        fmt = req.response_format
        if mode is not None:  # the answer: one JSON object naming a tool (treedraft.tools)
            own = None if fmt is None or fmt.get("type") == "text" else fmt
            try:
                fmt = answer_format(tools, mode, stop, own)
            except ToolRequestError as e:
                raise APIError(400, str(e), param=e.param) from None
            except ValueError as e:
                raise APIError(400, str(e), param="tools") from None
        regex, choice, constraint = text_constraint(req)
        if constraint:  # the regex / choice automaton (and once, the vocabulary's byte trie) off the event loop
            if mode is not None or (fmt is not None and fmt.get("type") != "text"):
                raise APIError(
                    400, f"{constraint} cannot be combined with tools or a JSON response_format", param=constraint
                )
            try:
                expr = regex if choice is None else choice_pattern(choice)
                await asyncio.get_running_loop().run_in_executor(pool, self.llm.text_grammar, expr)
            except ValueError as e:
                raise APIError(400, str(e), param=constraint) from None
        if fmt is not None:  # JSON mode's automaton: built once (~1.4 s) off the event loop
            try:
                await asyncio.get_running_loop().run_in_executor(pool, self.llm.json_grammar, fmt)
            except ValueError as e:  # a schema it does not support, say
                raise APIError(400, str(e), param="response_format" if mode is None else "tools") from None
        most = self.settings.max_batch + self.settings.max_queue  # running and waiting at once
        if len(prompts) * (req.n or 1) > most:
            what = f"n={req.n or 1}" if len(prompts) == 1 else f"{len(prompts)} prompts x n={req.n or 1}"
            raise APIError(
                400,
                f"{what} is more jobs than this server holds at once ({self.settings.max_batch} running + "
                f"{self.settings.max_queue} waiting); send fewer at a time",
                param="n" if len(prompts) == 1 else "prompt",
            )
        inc = bool(req.stream_options and req.stream_options.include_usage)
        given = prompt_list(req.prompt) if not chat and req.echo else []  # what each echo gives back
        out = []
        for k, prompt_ids in enumerate(prompts):
            where = "" if len(prompts) == 1 else f"prompt {k}: "
            try:
                self.llm.engine.check_prompt(prompt_ids)
            except GenerationError as e:
                raise APIError(
                    400,
                    where + str(e),
                    param="messages" if chat else "prompt",
                    code="context_length_exceeded" if len(prompt_ids) >= self.context else None,
                ) from None
            room = self.context - len(prompt_ids)
            budget = max_tokens
            if budget is None:
                budget = min(self.settings.default_max_tokens, self.tokens_limit, room)
            elif budget > room:
                raise APIError(
                    400,
                    f"{where}this model's context window is {self.context} tokens; the prompt has "
                    f"{len(prompt_ids)} and {pname}={budget} asks for more than the {room} left; "
                    f"lower {pname} or shorten the prompt",
                    param=pname,
                    code="context_length_exceeded",
                )
            try:
                cfg = self.llm.config(
                    max_new_tokens=max(budget, 1),  # score_only: never decoded
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=req.top_k or 0,
                    min_p=req.min_p or 0.0,
                    stop_token_ids=req.stop_token_ids or (),
                    seed=req.seed,
                    stop=stop,
                    rule=opts.rule or "speculative",
                    max_tree_nodes=opts.max_tree_nodes or 64,
                    logprobs=((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
                    min_tokens=req.min_tokens or 0,
                    response_format=fmt,
                    prediction=prediction,
                    regex=regex,
                    choice=choice,
                )
                cfg = replace(cfg, ignore_eos=bool(req.ignore_eos))
            except ValueError as e:  # e.g. rule 'greedy' with temperature > 0
                msg = str(e)
                param = next(
                    (x for x in ("logit_bias", "min_tokens", "ignore_eos", "stop_token_ids") if x in msg),
                    "treedraft.rule" if "rule" in msg else None,
                )
                raise APIError(400, msg, param=param) from None
            echo, lead = None, 0
            if given:
                p = given[k]
                tok = self.llm.tokenizer
                echo = p if isinstance(p, str) else tok.decode(prompt_ids, skip_special_tokens=False)
                lead = int(isinstance(p, str) and getattr(tok, "add_bos", False))  # encode_prompt's BOS: not in p
            out.append(
                _Prepared(
                    prompt_ids,
                    cfg,
                    drafter,
                    bool(req.stream),
                    inc,
                    model,
                    tenant,
                    echo,
                    req.n or 1,
                    lead,
                    score_only,
                    mode,
                )  # fmt: skip
            )
        return out

    def drafter_name(self, requested: str) -> str:
        """The name reported back: what 'default' resolves to, 'none' for plain decoding."""
        if requested == "default":
            d = self.llm.engine.drafter
            return "none" if d is None else getattr(d, "name", type(d).__name__)
        return "none" if requested == "plain" else requested

    # -- queueing

    def submit(self, p: _Prepared, scored_by: Job | None = None) -> Job:
        """Queue a job, or 429 + Retry-After when the queue is full. ``scored_by``: the same prompt's first choice,
        queued before this one, which scores an echoed prompt once for all its choices."""
        if not self.worker.alive():
            raise APIError(503, "the model worker is not running; restart the server", "server_error")
        if self.worker.failing is not None:  # a shutdown's grace period has ended: answered now, not after a step
            raise self.worker.failing
        job = Job(p.prompt_ids, p.config, p.drafter, asyncio.get_running_loop(), tenant=p.tenant)
        if p.echo is not None and p.config.logprobs is not None:
            if scored_by is None:
                job.score_top = p.config.logprobs
            job.scored_by = scored_by
        job.score_only = p.score_only
        if not self.worker.queue.put_nowait(job):
            raise self.queue_full()
        if self.worker.failing is not None and job.cancel():  # the drain began between the check and the queue
            raise self.worker.failing
        self.metrics.requests.inc()
        return job

    def queue_full(self) -> APIError:
        """The 429 (+ Retry-After) of a server whose batch is full and whose queue is full behind it."""
        s = self.settings
        return APIError(
            429,
            f"the server is busy: {s.max_batch} requests running and its queue is full ({s.max_queue} waiting); "
            f"retry after {s.retry_after_s}s",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(s.retry_after_s)},
        )

    def cancel(self, job: Job) -> None:
        """Stop a job. One still waiting in the queue is counted as aborted here: it never reaches the worker, which
        counts the others (a request's every choice is a job: an n=3 request dropped while queued is 3 aborted)."""
        if job.cancel():
            self.metrics.aborted.inc()

    async def next_or_disconnect(self, job: Job, request: Request) -> Chunk | Done | Failed | None:
        """The worker's next item; None (and the job cancelled) once the client has gone.

        The client is checked at least every ``poll_interval_s``, also while items keep arriving (a non-streamed
        request reads no socket until it answers: without this, a client that left went on costing its slot until
        ``max_tokens``)."""
        poll = self.settings.poll_interval_s
        while True:
            item = await job.next(poll)
            now = time.monotonic()
            if item is not None and now - job.checked_at < poll:
                return item
            job.checked_at = now
            if await request.is_disconnected():
                self.cancel(job)
                return None
            if item is not None:
                return item

    async def serve(self, request: Request, preps: list[_Prepared], chat: bool) -> Response:
        """Queue the request (each prompt's n choices, in order), wait for its first output (or error), then answer
        or start streaming."""
        jobs: list[tuple[_Prepared, Job]] = []
        first: Chunk | Done | Failed | None = None
        if self.worker.queue.room() < sum(p.n for p in preps):  # all of its choices or none: no half-queued request
            raise self.queue_full()
        try:
            for p in preps:
                for i in range(p.n):
                    jobs.append((p, self.submit(p.choice(i), jobs[-i][1] if i else None)))
            first = await self.next_or_disconnect(jobs[0][1], request)
        finally:
            if not isinstance(first, (Chunk, Done)):  # an error, a failed job or a client gone: free every job
                for _, j in jobs:
                    self.cancel(j)
        if first is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if isinstance(first, Failed):
            raise first.error
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if jobs[0][0].stream:
            return _JobStreamingResponse(
                self.stream_events(jobs, first, rid, created, chat), [j for _, j in jobs], self.cancel
            )
        return await self.collect(request, jobs, first, rid, created, chat)

    # -- responses

    async def collect(
        self,
        request: Request,
        jobs: list[tuple[_Prepared, Job]],
        first: Chunk | Done | Failed,
        rid: str,
        created: int,
        chat: bool,
    ) -> Response:
        """A whole (non-streamed) completion: one choice per job, in order (prompt by prompt, n choices each, as
        OpenAI numbers them; they decode together). ``treedraft`` reports the first choice's decoding."""
        choices, n, done = [], 0, None
        try:
            for i, (p, job) in enumerate(jobs):
                got = await self.gather(request, job, first if i == 0 else None, p, chat, i)
                if got is None:
                    return Response(status_code=499)
                choice, k, end = got
                choices.append(choice)
                n += k
                done = done or end
        finally:
            for _, job in jobs:
                self.cancel(job)  # a no-op once done; frees the worker on any other exit
        p = jobs[0][0]
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": p.model,
                "system_fingerprint": None,
                "choices": choices,
                "usage": _usage(_prompt_tokens(jobs), n, [j for _, j in jobs]),
                "treedraft": _spec_info(self.drafter_name(p.drafter), done.stats),
            }
        )

    async def gather(
        self, request: Request, job: Job, item: Chunk | Done | Failed | None, p: _Prepared, chat: bool, index: int
    ) -> tuple[dict, int, Done] | None:
        """Run one job to its end: (its choice, the tokens it generated, its Done); None once the client has gone."""
        texts: list[str] = []
        lps: list[TokenLogprob] = []
        n = 0
        while not isinstance(item, Done):
            if isinstance(item, Failed):
                raise item.error
            if item is not None:
                texts.append(item.text)
                lps += self.reported_logprobs(p, item)
                n += len(item.token_ids)
            item = await self.next_or_disconnect(job, request)
            if item is None:
                return None
        text = "".join(texts)
        logprobs = None
        if p.config.logprobs is not None:
            at = None
            if not chat:  # text_offset: completions only
                offsets = self.text_offsets()
                at = offsets.take(job.prompt_scores(), p.echo_lead, generated=False) if p.echo is not None else []
                at += offsets.take(lps)
            if p.echo is not None:
                lps = job.prompt_scores() + lps
            logprobs = self.logprobs_object(lps, chat, at)
        if p.echo is not None:
            text = p.echo + text
        if chat:
            message, finish = {"role": "assistant", "content": text}, item.finish_reason
            if p.tool_mode is not None:
                message, finish = answer_message(text, finish, p.tool_mode)
            choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": item.finish_reason}
        return choice, n, item

    async def stream_events(
        self, jobs: list[tuple[_Prepared, Job]], first: Chunk | Done | Failed, rid: str, created: int, chat: bool
    ) -> AsyncIterator[bytes]:
        """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``: every job's choice events
        (each chunk one choice, its ``index`` the job's place: prompt by prompt, n choices each) as they come,
        then the usage (with ``stream_options.include_usage``; ``treedraft``: the first choice's decoding)."""
        p0 = jobs[0][0]
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": p0.model,
            "system_fingerprint": None,
        }
        extra = {"usage": None} if p0.include_usage else {}
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, p: _Prepared, job: Job, item: Chunk | Done | Failed | None) -> None:
            try:
                async for ev in self.choice_events(job, item, p, index, chat):
                    await events.put(ev)
            except Exception as e:  # never leave the merged stream waiting for a choice that cannot come
                log.exception("streaming choice %d failed", index)
                err = APIError(500, f"internal server error: {type(e).__name__}", "server_error")
                await events.put(("failed", index, Failed(err)))

        tasks = [asyncio.create_task(pump(i, p, job, first if i == 0 else None)) for i, (p, job) in enumerate(jobs)]
        left, n, stats = len(jobs), 0, None
        try:
            while left:
                kind, index, payload = await events.get()
                if kind == "choice":
                    yield _sse({**base, "choices": [payload], **extra})
                elif kind == "failed":  # headers are already sent: report in-band, like vLLM
                    self.metrics.error(payload.error.status)
                    yield _sse(payload.error.body())
                    break
                else:  # done: (its Done, the tokens it generated)
                    left -= 1
                    n += payload[1]
                    stats = payload[0].stats if index == 0 else stats
            if not left and p0.include_usage:
                usage = {**base, "choices": [], "usage": _usage(_prompt_tokens(jobs), n, [j for _, j in jobs])}
                yield _sse(usage | {"treedraft": _spec_info(self.drafter_name(p0.drafter), stats)})
            yield _sse("[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            for _, job in jobs:
                self.cancel(job)

    async def choice_events(
        self, job: Job, item: Chunk | Done | Failed | None, p: _Prepared, index: int, chat: bool
    ) -> AsyncIterator[tuple[str, int, Any]]:
        """One job's stream: ("choice", index, the chunk's choice) items, then ("done", index, (Done, tokens)) or
        ("failed", index, Failed). ``item``: the job's first item when already taken (else None)."""
        want = p.config.logprobs is not None
        pending: list[TokenLogprob] = []  # reported with the next event: a token's text may come out later
        offsets = None if chat else self.text_offsets()  # text_offset: completions only

        def choice(text: str | None, finish: str | None, role: bool = False, echo: bool = False) -> dict:
            lp = None
            if want and not role and pending:
                at = None
                if offsets is not None:
                    at = offsets.take(pending, p.echo_lead, generated=False) if echo else offsets.take(pending)
                lp = self.logprobs_object(pending, chat, at)
                pending.clear()
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
                return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}

        n = 0
        # a tool answer: a call is sent whole at its end; with "auto", a "response" streams its text as it comes
        held: list[str] | None = [] if p.tool_mode is not None else None
        said = ResponseText() if p.tool_mode == "auto" else None
        if chat:
            yield "choice", index, choice(None, None, role=True)
        if item is None:
            item = await job.next(3600.0)
        while item is None:  # a disconnect cancels the stream, so there is nothing else to watch
            item = await job.next(3600.0)
        if p.echo is not None and not isinstance(item, Failed):  # the prompt (and its logprobs) first
            pending += job.prompt_scores()
            yield "choice", index, choice(p.echo, None, echo=True)
        while True:
            if isinstance(item, Failed):
                yield "failed", index, item
                return
            if isinstance(item, Done):
                finish = item.finish_reason
                if held is not None:  # a tool answer
                    message, finish = answer_message("".join(held), finish, p.tool_mode)
                    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                    if said is not None and said.mode == "response":  # its text went out as it came
                        delta.pop("content", None)
                        rest = said.feed("")
                        if rest:
                            delta["content"] = rest
                    for i, call in enumerate(delta.get("tool_calls", [])):
                        call["index"] = i
                    if delta or pending:
                        yield "choice", index, choice("", None) | {"delta": delta}
                yield "choice", index, choice(None if chat else "", finish)
                yield "done", index, (item, n)
                return
            n += len(item.token_ids)
            pending += self.reported_logprobs(p, item)
            if held is not None:
                held.append(item.text)
                text = said.feed(item.text) if said is not None else ""
                if text:
                    yield "choice", index, choice(text, None)
            elif item.text:
                yield "choice", index, choice(item.text, None)
            nxt = await job.next(3600.0)
            while nxt is None:
                nxt = await job.next(3600.0)
            item = nxt

    def reported_logprobs(self, p: _Prepared, item: Chunk) -> list[TokenLogprob]:
        """The logprobs of a chunk's tokens that a response reports: all but an EOS id (not content)."""
        if p.config.logprobs is None or not item.logprobs:
            return []
        eos = self.llm.text.ending_ids(p.config)
        return [x for x in item.logprobs if x.token_id not in eos]

    def token_text(self, token_id: int) -> str:
        """One token's text as the responses' logprobs name it (decoded alone; cached)."""
        t = self._token_texts.get(token_id)
        if t is None:
            t = self._token_texts[token_id] = self.llm.tokenizer.decode([token_id], skip_special_tokens=False)
        return t

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes as chat logprobs report them: its raw bytes where the tokenizer knows them (part of a
        character included; :meth:`treedraft.tokenizer.Tokenizer.token_bytes`), else its text's UTF-8."""
        f = getattr(self.llm.tokenizer, "token_bytes", None)
        return f(token_id) if f is not None else self.token_text(token_id).encode("utf-8")

    def text_offsets(self) -> _TextOffsets:
        """A fresh ``text_offset`` counter for one completions choice."""
        strip = getattr(self.llm.tokenizer, "leading_strip", 0)
        return _TextOffsets(self.token_bytes, self._special, strip)

    def logprobs_object(self, lps: list[TokenLogprob], chat: bool, offsets: list[int] | None) -> dict:
        """OpenAI's ``logprobs`` of a choice or a streamed chunk for tokens ``lps``: chat's ``content`` entries
        (token, logprob, bytes, top_logprobs) or the completions' parallel lists (``text_offset``: ``offsets``,
        from :class:`_TextOffsets`). Values are the model's own log-softmax (before temperature / top-k / top-p);
        -inf is reported as -9999."""

        def val(x: float | None) -> float | None:
            return None if x is None else max(x, -9999.0)

        if chat:
            return {
                "content": [
                    {
                        "token": self.token_text(x.token_id),
                        "logprob": val(x.logprob),
                        "bytes": list(self.token_bytes(x.token_id)),
                        "top_logprobs": [
                            {"token": self.token_text(i), "logprob": val(v), "bytes": list(self.token_bytes(i))}
                            for i, v in x.top
                        ],
                    }
                    for x in lps
                ]
            }
        return {
            "tokens": [self.token_text(x.token_id) for x in lps],
            "token_logprobs": [val(x.logprob) for x in lps],
            "top_logprobs": [
                None if x.logprob is None else {self.token_text(i): val(v) for i, v in x.top} for x in lps
            ],
            "text_offset": list(offsets),
        }

    def models(self) -> dict:
        """The /v1/models listing."""
        return {
            "object": "list",
            "data": [
                {
                    "id": n,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "treedraft",
                    "root": self.llm.model_name,
                    "max_model_len": self.context,
                }
                for n in self.names
            ],
        }


def create_app(llm: LLM, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI application serving ``llm``; the worker starts and stops with the app's lifespan."""
    srv = OpenAIServer(llm, settings)
    metrics = srv.metrics

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        srv.start()
        try:
            yield
        finally:
            srv.stop()

    app = FastAPI(title="treedraft", version=_version(), lifespan=lifespan)
    app.state.treedraft = srv

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, e: APIError) -> JSONResponse:
        metrics.error(e.status)
        return e.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(_req: Request, _e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException) -> JSONResponse:
        metrics.error(e.status_code)
        err = APIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, e: RequestValidationError) -> JSONResponse:
        metrics.error(400)
        return APIError(400, f"invalid request: {e.errors()[:1]}").response()

    @app.exception_handler(Exception)
    async def _internal_error(_req: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        metrics.error(500)
        return APIError(500, f"internal server error: {type(e).__name__}", "server_error").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions (stream or not)."""
        req = await srv.read(request, ChatCompletionRequest)
        return await srv.serve(request, await srv.prepare(req, srv.tenant(request, req)), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI text completions on a raw prompt (no chat template)."""
        req = await srv.read(request, CompletionRequest)
        return await srv.serve(request, await srv.prepare(req, srv.tenant(request, req)), chat=False)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model (and its aliases)."""
        return srv.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        """One served name (``client.models.retrieve``); 404 for any other."""
        for m in srv.models()["data"]:
            if m["id"] == model_id:
                return m
        raise APIError(404, f"model {model_id!r} is not served here; see GET /v1/models", code="model_not_found")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 while the worker thread is alive, else 503."""
        if not srv.worker.alive():
            return APIError(503, "the model worker is not running", "server_error").response()
        return JSONResponse(
            {
                "status": "ok",
                "model": srv.names[0],
                "waiting": len(srv.worker.queue),
                "running": len(srv.worker.running),
            }
        )

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        """Prometheus metrics (text format; OpenMetrics when the scraper asks for it)."""
        body, content_type = metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    if srv.settings.api_keys:  # outside the routes, so that unknown paths are 401 too, not 404
        app.add_middleware(
            AuthMiddleware,
            keys=APIKeys(srv.settings.api_keys),
            protect_open_paths=srv.settings.protect_health_metrics,
            on_reject=metrics.error,
        )
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer has one, a 401 too

    return app


class RequestIdMiddleware:
    """An ``x-request-id`` header on every response, as OpenAI's API sends (its SDK shows it with errors and in
    logs): the client's own ``x-request-id`` echoed where it sent a short printable one, else a new ``req-<hex>``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        ok = 0 < len(given) <= 128 and all(33 <= c < 127 for c in given)
        rid = given if ok else f"req-{uuid.uuid4().hex}".encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _version() -> str:
    from .. import __version__

    return __version__
