"""The OpenAI wire protocol: server limits, request models, body parsing and validation, errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ..logprobs import MAX_TOP_LOGPROBS
from ..tools import Tool, parse_tools, tool_mode

MAX_CHOICES = 16  # n: choices per request, each its own job in the batch


def request_drafters() -> tuple[str, ...]:
    """Drafter names a request may pick: the registry's, plus 'default' (the server's own) and 'plain'."""
    from ..drafters.registry import choices

    return choices()


MAX_TREE_NODES_LIMIT = 512


# ----------------------------------------------------------------------------- settings + errors


@dataclass(frozen=True)
class ServerSettings:
    """Limits and names of one server instance."""

    max_queue: int = 64  # requests allowed to wait behind the running ones; more -> 429
    max_batch: int = 8  # requests decoded together (one target forward per step)
    step_rows: int | None = None  # tree rows per step shared by the batch (None: from the latency curve)
    prefill_chunk: int | None = 256  # prompt rows per step for joining requests (None: whole prompts)
    native_prefill: bool = True  # prompt chunks through the native decoder (faster; the CLI's arithmetic too)
    prefix_cache_mb: int = 256  # finished prompt prefills kept for reuse, per tenant (0: off; scheduler docs)
    max_tokens_limit: int | None = None  # largest max_tokens accepted (None: context window - 1)
    default_max_tokens: int = 256  # when a request gives none (capped by what the context leaves)
    served_model_names: tuple[str, ...] = ()  # names accepted in "model" (empty: the loaded model's name)
    heads: str | None = "default"  # Medusa heads for requests that pick drafter "medusa"
    retry_after_s: int = 1  # Retry-After header on 429
    poll_interval_s: float = 0.25  # how often a waiting handler checks for a client disconnect
    max_body_bytes: int = 8 * 1024 * 1024
    # a request body that stalls this long between two of its chunks is answered 408 and its connection closed (a
    # client sending its headers and a few bytes, then nothing, held a connection for as long as it liked)
    body_timeout_s: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # Bearer keys; empty: no authentication
    protect_health_metrics: bool = False  # with api_keys: /health and /metrics need a key too

    def __post_init__(self) -> None:
        from .auth import APIKeys

        APIKeys(self.api_keys)  # raises ValueError naming what to fix
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.step_rows is not None and self.step_rows < 1:
            raise ValueError(f"step_rows must be >= 1, got {self.step_rows}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 turns the prefix cache off), got {self.prefix_cache_mb}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body of this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ----------------------------------------------------------------------------- request schemas

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall

    @field_validator("id", mode="before")
    @classmethod
    def _null_id(cls, v: object) -> object:
        return "" if v is None else v  # explicit JSON null: none given, as with every optional field


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    # after the fields its check reads; None only in an assistant turn that called tools
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_given(cls, v: object, info: ValidationInfo) -> object:
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (null only in an assistant message with tool_calls)")
        return v

    def text(self) -> str:
        """The message content as one string."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict:
        """The message as :func:`treedraft.tools.render_messages` reads it (developer is a system message)."""
        out: dict = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:  # for the chat template (as vLLM passes it): one that has no use for it ignores it
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False  # (null: the default)


class TreedraftOptions(BaseModel):
    """The ``"treedraft"`` extension field: per-request drafter, tree budget and acceptance rule."""

    model_config = ConfigDict(strict=True, extra="forbid")
    drafter: str | None = None
    rule: str | None = None
    max_tree_nodes: int | None = Field(None, ge=1, le=MAX_TREE_NODES_LIMIT)


class CommonRequest(BaseModel):
    # unknown fields are kept (model_extra) so that reject_unsupported can name OpenAI's unsupported ones
    # allow_inf_nan False: a NaN temperature is "not a finite number", not "should be less than or equal to 2"
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = None
    # explicit JSON null means "default" for every optional field, as with OpenAI's API
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None -> 1.0, OpenAI's default
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # vLLM-style extra; 0 disables
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM-style extra; 0 disables
    stop_token_ids: list[int] | None = None  # vLLM-style extra: these ids end the answer as EOS does
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM-style extra
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # OpenAI's range; on the output's tokens
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)  # vLLM-style extra; prompt + output, 1 = off
    min_tokens: int | None = Field(None, ge=0)  # vLLM-style extra: no EOS before this many tokens
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema"} (JSON mode)
    prediction: dict[str, Any] | None = None  # predicted output: {"type": "content", "content": text or text parts}
    # vLLM's extras for constrained free text (treedraft.text_grammar): the whole answer matches a regular
    # expression, or is one of the strings; structured_outputs {"regex": ...} / {"choice": [...]} is vLLM's newer form
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    treedraft: TreedraftOptions | None = None


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # OpenAI's function tools (treedraft.tools)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # one call per answer here, which either value allows


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


# pydantic tags each member of a union field in an error's location; say what the union accepts instead
_UNION_TAGS = {"str", "list[str]", "list[int]", "list[TextPart]"}
_UNION_HELP = {
    "stop": "should be a string or a list of strings",
    "prompt": "should be a string, a list of token ids, or a list of either (several prompts)",
    "content": 'should be a string or a list of {"type": "text", "text": ...} parts',
}


def _error_location(loc: tuple) -> tuple[tuple, bool]:
    """Error location without union-member tags; True when a tag was cut."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and part in _UNION_TAGS:
            return loc[:i], True
    return loc, False


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; any problem -> a 400 APIError naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise APIError(400, "the request body must be a JSON object") from None
        loc, in_union = _error_location(first["loc"])
        msg = _UNION_HELP.get(str(loc[-1]) if loc else "", first["msg"]) if in_union else first["msg"]
        others = {_error_location(x["loc"])[0] for x in errs} - {loc}
        more = f" (and {len(others)} more problem{'s' if len(others) > 1 else ''})" if others else ""
        param = ".".join(str(p) for p in loc)
        raise APIError(400, f"{param or 'body'}: {msg}{more}", param=param or None) from None


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A completions ``prompt`` as its prompts: a string or one token-id list is one; a list of strings or of
    token-id lists is several (OpenAI's batch form, e.g. lm-evaluation-harness's tokenized requests)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def chat_tools(req: ChatCompletionRequest) -> tuple[list[Tool], str | None]:
    """A chat request's tools and tool mode (:func:`treedraft.tools.tool_mode`); 400 naming what is wrong."""
    try:
        tools = parse_tools(req.tools) if req.tools is not None else []
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
    try:
        return tools, tool_mode(req.tool_choice, tools)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None


# OpenAI request fields that change the answer and that this server does not implement -> what to send instead.
# Other unknown fields (store, metadata, service_tier, ...) change nothing here and are ignored, as vLLM does.
_LEGACY_FUNCTIONS = (
    "the deprecated functions / function_call are not supported; send them as tools "
    '([{"type": "function", "function": {...}}]) and tool_choice'
)
UNSUPPORTED_FIELDS = {
    "functions": _LEGACY_FUNCTIONS,
    "function_call": _LEGACY_FUNCTIONS,
    "audio": "audio output is not supported; this server answers in text",
    "web_search_options": "web search is not supported",
    # vLLM's extras that change the answer, beside the ones implemented (guided_regex / guided_choice, top_k, ...)
    "guided_json": 'guided_json is not supported; send response_format {"type": "json_schema", "json_schema": '
    '{"name": ..., "schema": ...}}',
    "guided_grammar": "guided_grammar is not supported; use guided_regex, guided_choice or response_format",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported: the stop string is never in the text",
    "bad_words": "bad_words is not supported; ban single tokens with logit_bias {token id: -100}",
    "allowed_token_ids": "allowed_token_ids is not supported; use guided_choice or guided_regex",
    "continue_final_message": "continue_final_message is not supported: the answer is always a new assistant turn",
    "add_generation_prompt": "add_generation_prompt is not supported: the answer is always a new assistant turn",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported; send a prompt that fits the context window",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty (beam search) is not supported",
    "logits_processors": "logits_processors are not supported",
    "prompt_logprobs": "prompt_logprobs is not supported; on /v1/completions use echo with logprobs",
}


def prediction_text(req: CommonRequest) -> str | None:
    """The text of OpenAI's ``prediction`` ({"type": "content", "content": a string or [{"type": "text", "text":
    ...}, ...]}); None without one. 400 for any other shape."""
    pred = req.prediction
    if pred is None:
        return None
    content = pred.get("content")
    if pred.get("type") != "content":
        raise APIError(400, f"prediction type must be 'content', got {pred.get('type')!r}", param="prediction")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in content
    ):
        return "".join(x["text"] for x in content)
    raise APIError(
        400,
        'prediction content must be a string or a list of {"type": "text", "text": "..."} parts',
        param="prediction.content",
    )


def text_constraint(req: CommonRequest) -> tuple[str | None, list[str] | None, str]:
    """(regex, choice, the field that gave it) from guided_regex / guided_choice / structured_outputs; 400 for two
    at once or a structured_outputs key other than regex / choice (their values are checked where the automaton is
    built: treedraft.text_grammar)."""
    given = []
    if req.guided_regex is not None:
        given.append((req.guided_regex, None, "guided_regex"))
    if req.guided_choice is not None:
        given.append((None, req.guided_choice, "guided_choice"))
    so = req.structured_outputs
    if so is not None:
        bad = sorted(k for k, v in so.items() if v is not None and k not in ("regex", "choice"))
        if bad:
            raise APIError(
                400,
                f"structured_outputs {', '.join(bad)} is not supported here; use regex or choice, or response_format "
                "for JSON",
                param="structured_outputs",
            )
        if so.get("regex") is not None:
            given.append((so["regex"], None, "structured_outputs.regex"))
        if so.get("choice") is not None:
            given.append((None, so["choice"], "structured_outputs.choice"))
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(g[2] for g in given)}", param=given[1][2])
    return given[0] if given else (None, None, "")


def reject_unsupported(req: CommonRequest) -> None:
    """400 for OpenAI parameters this server does not implement (never silently ignored)."""
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED_FIELDS and value is not None:
            raise APIError(400, UNSUPPORTED_FIELDS[name], param=name)
    modalities = (req.model_extra or {}).get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise APIError(
            400, f'modalities {modalities!r} is not supported; this server answers in ["text"]', param="modalities"
        )
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in 1..{MAX_CHOICES}, got {req.n}", param="n")
    seen: set[int] = set()
    for k in req.logit_bias or {}:
        if not (k.isascii() and k.isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids (decimal integers), got {k!r}", param="logit_bias")
        if int(k) in seen:
            raise APIError(400, f"logit_bias names token {int(k)} more than once", param="logit_bias")
        seen.add(int(k))
    kind = None if req.response_format is None else req.response_format.get("type")
    if req.response_format is not None and kind not in ("text", "json_object", "json_schema"):
        raise APIError(
            400,
            f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
            param="response_format",
        )
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed together with stream=true", param="stream_options")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(
                400, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {req.top_logprobs}", param="top_logprobs"
            )
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {req.logprobs}", param="logprobs")
        if req.best_of not in (None, 1):
            raise APIError(400, f"best_of={req.best_of} is not supported; use 1", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
