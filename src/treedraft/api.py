"""Python API: ``treedraft.load(...)`` -> :class:`LLM` with ``generate`` and ``stream``.

A thin facade: the models layer loads the target, the drafter registry builds drafters by name,
the engine decodes token ids and the text layer turns them into text.
"""

from __future__ import annotations

import atexit
import gc
import json
import numbers
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .drafters.registry import DEFAULT, DrafterCache, DrafterOptions, canonical, check_files
from .drafters.suffix_store import DEFAULT_MAX_TOKENS
from .engine import Engine, GenerationConfig, GenerationStats
from .grammar import JsonGrammar
from .interfaces import Drafter, GenerationError
from .models.gguf_meta import model_architecture
from .models.plan import pack_tuned
from .models.registry import DEFAULT_MODEL, cache_dir, file_key, load_own, resolve
from .penalties import Penalties
from .sampling import SamplingParams
from .text import Chunk, GenerationResult, TextGenerator
from .tokenizer import Tokenizer

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


DEFAULT_MAX_SEQ_LEN = 4096  # load()'s context window when not given (the CLI's --max-seq-len default too)


def _prompt_type(prompt: object) -> None:
    """GenerationError unless ``prompt`` is a string or a list of chat messages."""
    if not isinstance(prompt, (str, list)):
        raise GenerationError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def pick_device(device: str = "auto") -> str:
    """'auto' -> cuda when present, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda[:N]")
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' -> fp32 on cpu, bf16 on cuda."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, fp32, bf16 or fp16")
    return DTYPES[dtype]


def _stop_strings(stop) -> tuple:
    """``stop`` as a tuple: one string is one stop string and None none (as in OpenAI's API); else any iterable of
    them (each checked by GenerationConfig)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, Iterable) and not isinstance(stop, (bytes, bytearray, Mapping)):
        return tuple(stop)
    raise GenerationError(f"stop must be a string or a list of strings, got {stop!r} ({type(stop).__name__})")


@dataclass
class LLM:
    """A loaded target model + tokenizer + default drafter, ready to generate."""

    engine: Engine
    tokenizer: Tokenizer | None
    model_name: str
    device: str
    heads: str | None = DEFAULT  # the heads argument of load(): used by drafters chosen by name later on
    suffix_store: Any = None  # the SuffixStore of drafter "suffix" (None: each built one keeps its own, in memory)
    draft_model: str | None = None  # drafter "draft-model": its model (None: the target's own file)
    draft_weights: str = "auto"  # ... and the weights it drafts with
    drafters: DrafterCache = field(init=False, repr=False)  # drafters built by name, reused
    text: TextGenerator = field(init=False, repr=False)  # the engine wrapped with detokenization, stop, EOS
    _json: JsonGrammar | None = field(default=None, init=False, repr=False)  # JSON mode's automaton, once built
    _schemas: dict = field(default_factory=dict, init=False, repr=False)  # json_schema automata by schema text
    # _lock guards the automata caches only (a dict access: the server's event loop takes it in config()); the
    # vocabulary indexes are built under _build_lock, and automata compile outside both, so a request whose
    # automaton is cached never waits on another request's build
    _lock: Any = field(default_factory=threading.Lock, init=False, repr=False)
    _build_lock: Any = field(default_factory=threading.Lock, init=False, repr=False)
    _text_vocab: Any = field(default=None, init=False, repr=False)  # regex / choice answers' vocabulary index
    _regexes: dict = field(default_factory=dict, init=False, repr=False)  # their automata by expression

    def __post_init__(self) -> None:
        self.drafters = DrafterCache(
            self.engine.model,
            self.tokenizer,
            DrafterOptions(
                self.model_name,
                self.heads,
                suffix_store=self.suffix_store,
                draft_model=self.draft_model,
                draft_weights=self.draft_weights,
            ),
        )
        self.text = TextGenerator(self.engine, self.tokenizer)

    @property
    def model(self):
        """The target model."""
        return self.engine.model

    def close(self) -> None:
        """Record any request still in progress with drafters that keep state (``flush``), then close the suffix
        store. Idempotent; :func:`load` also runs it at interpreter exit."""
        for d in (self.engine.drafter, *self.drafters.built()):
            for member in (d, *getattr(d, "drafters", ())):  # a hybrid's members too
                flush = getattr(member, "flush", None)
                if callable(flush):
                    flush()
        if self.suffix_store is not None:
            self.suffix_store.close()

    def encode_prompt(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """Chat messages or a user string -> ids (chat template unless raw or no template)."""
        if self.tokenizer is None:
            raise GenerationError(
                "this LLM has no tokenizer (e.g. a callable target): pass token ids to llm.engine.generate(ids, ...)"
            )
        if isinstance(prompt, list):  # read as the server reads a request's messages (roles, parts, tool turns)
            from .tools import chat_dicts, render_messages

            if raw:  # (it was ignored: the template applied anyway)
                raise GenerationError("raw=True takes a string prompt; chat messages are always read with the template")

            try:
                return self.tokenizer.apply_chat_template(render_messages(chat_dicts(prompt), (), None))
            except GenerationError:
                raise
            except ValueError as e:  # (a model without a chat template says so here too)
                raise GenerationError(str(e)) from None
        _prompt_type(prompt)
        if not prompt.strip():
            raise GenerationError("the prompt is empty; give some text")
        if raw or not self.tokenizer.is_chat:
            ids = self.tokenizer.encode(prompt)
            bos = getattr(self.tokenizer.hf, "bos_token_id", None)
            if getattr(self.tokenizer, "add_bos", False) and bos is not None:
                ids = [bos] + ids
            return ids
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])

    def config(
        self,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | list[str] | tuple[str, ...] | None = (),
        min_p: float = 0.0,
        stop_token_ids: Sequence[int] = (),
        rule: str = "speculative",
        max_tree_nodes: int = 64,
        logprobs: int | None = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int = 0,
        response_format: str | dict | None = None,
        prediction: str | Sequence[int] | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
    ) -> GenerationConfig:
        """A :class:`GenerationConfig` from keyword arguments. ``logprobs``: None (off), or n: each generated
        token's log-probability and its position's n most likely alternatives (``GenerationResult.logprobs``,
        ``Chunk.logprobs``; the model's own distribution, before penalties, temperature / top-k / top-p), one entry
        per id of ``token_ids``, so an ending EOS or ``stop_token_ids`` id has one (the server leaves those out of
        its responses' logprobs, as it does of their text).
        Penalties (:mod:`treedraft.penalties`): ``repetition_penalty`` r > 0 on every token of the prompt and the
        output so far (logit / r where positive, * r where not; 1.0 off), ``presence_penalty`` and
        ``frequency_penalty`` in [-2, 2] on the output's tokens (OpenAI's; 0 off); ``logit_bias`` {token id: amount
        in [-100, 100]} added to those logits at every position, before the penalties (OpenAI's); ``min_tokens``:
        no EOS before the output holds that many tokens (vLLM's); speculative output stays the plain (penalised)
        output. ``response_format``: ``"json_object"`` (or OpenAI's ``{"type": "json_object"}``) constrains the
        answer to one JSON object (:mod:`treedraft.grammar`), ``{"type": "json_schema", "json_schema": {"schema": ...}}``
        to one valid under that JSON Schema (:meth:`json_grammar`); None or ``"text"``: free text. ``prediction``
        (OpenAI's predicted outputs): text (or token ids) the answer is expected to resemble, e.g. the code an edit
        rewrites; the text drafters (prompt lookup, suffix, and so the default) draft from it too. Only the speed
        changes: the answer is the one it would be without. ``regex`` (vLLM's guided_regex): the whole answer is a
        match of this regular expression (:mod:`treedraft.text_grammar`); ``choice`` (guided_choice): the answer is
        exactly one of these strings. At most one of response_format, regex and choice."""
        if logit_bias is not None and not isinstance(logit_bias, Mapping):
            raise GenerationError(f"logit_bias must be a dict {{token id: bias}}, got {type(logit_bias).__name__}")
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
            raise GenerationError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
        stop_token_ids = list(stop_token_ids)
        # ("12" and 2.9 were coerced to (1, 2) and 2)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in stop_token_ids):
            raise GenerationError(f"stop_token_ids must be integer token ids, got {stop_token_ids!r}")
        if isinstance(max_tree_nodes, bool) or not isinstance(max_tree_nodes, numbers.Integral):
            raise GenerationError(f"max_tree_nodes must be an integer >= 1, got {max_tree_nodes!r}")
        bias = tuple((t, float(v)) for t, v in (logit_bias or {}).items())
        stop_ids = tuple(int(t) for t in stop_token_ids)
        bad = [t for t in stop_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise GenerationError(
                f"stop_token_ids {bad} are outside this model's vocabulary of {self.model.vocab_size}"
            )
        eos = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(stop_ids)))  # min_tokens holds all of them back
        penalties = Penalties(repetition_penalty, presence_penalty, frequency_penalty, bias, min_tokens, eos)
        penalties.check_vocab(self.model.vocab_size)
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(temperature, top_k, top_p, seed, min_p),
            rule=rule,
            stop=_stop_strings(stop),
            max_tree_nodes=max_tree_nodes,
            logprobs=logprobs,
            penalties=penalties,
            grammar=self.answer_grammar(response_format, regex, choice),
            prediction=self.prediction_ids(prediction),
            stop_token_ids=stop_ids,
        )

    def prediction_ids(self, prediction: str | Sequence[int] | None) -> tuple[int, ...]:
        """A predicted output as token ids: text is encoded as it stands (no chat template, no BOS)."""
        if prediction is None:
            return ()
        if isinstance(prediction, str):
            return tuple(self.tokenizer.encode(prediction))
        ids = None
        if hasattr(prediction, "tolist"):
            ids = prediction.tolist()  # a numpy array or tensor of ids (a scalar's tolist is no list)
        elif isinstance(prediction, Sequence) and not isinstance(prediction, (bytes, bytearray)):
            ids = list(prediction)
        if isinstance(ids, list) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < self.model.vocab_size for t in ids
        ):
            return tuple(int(t) for t in ids)
        raise GenerationError(
            f"prediction must be a string or a list of token ids in [0, {self.model.vocab_size}), "
            f"got {type(prediction).__name__}"
        )

    def answer_grammar(self, response_format: str | dict | None, regex: str | None, choice: Sequence[str] | None):
        """The automaton the answer follows: JSON (:meth:`json_grammar`), a regular expression or a choice
        (:meth:`text_grammar`), or None for free text."""
        kind = response_format.get("type") if isinstance(response_format, dict) else response_format
        given = [n for n, on in (("response_format", kind not in (None, "text")), ("regex", regex is not None),
                                 ("choice", choice is not None)) if on]  # fmt: skip
        if len(given) > 1:
            raise GenerationError(f"give one of {' / '.join(given)}: each constrains the whole answer")
        if regex is not None or choice is not None:
            from .text_grammar import choice_pattern

            try:
                return self.text_grammar(regex if choice is None else choice_pattern(choice))
            except ValueError as e:
                raise GenerationError(str(e)) from None
        return self.json_grammar(response_format)

    def text_grammar(self, regex: str):
        """The automaton of answers that match ``regex`` whole (:class:`treedraft.text_grammar.TextGrammar`); the
        vocabulary's byte trie is built at the first call and shared, the automata kept for reuse (the last 32)."""
        from .text_grammar import TextVocab

        if self._text_vocab is None:
            with self._build_lock:
                if self._text_vocab is None:
                    self._text_vocab = TextVocab.from_tokenizer(self.tokenizer, self.model.vocab_size)
        return self._cached(self._regexes, regex, lambda: self._text_vocab.grammar(regex))

    def _cached(self, cache: dict, key: Any, build: Callable[[], Any]) -> Any:
        """``cache[key]`` (most recent last, the last 32 kept), built by ``build`` outside the lock when missing (two
        threads may both build it; one result is kept)."""
        with self._lock:
            g = cache.pop(key, None)
            if g is not None:
                cache[key] = g
                return g
        g = build()
        with self._lock:
            g = cache.pop(key, None) or g
            cache[key] = g
            while len(cache) > 32:
                cache.pop(next(iter(cache)))
        return g

    def json_grammar(self, response_format: str | dict | None) -> JsonGrammar | None:
        """The automaton of ``response_format`` (:mod:`treedraft.grammar`): "json_object" / ``{"type":
        "json_object"}`` any JSON object, ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` (OpenAI's
        shape) objects valid under that schema; None for "text" or None. The vocabulary's index is built at the
        first call (~1.4 s for 49k tokens) and shared; schemas' automata are kept for reuse (the last 32)."""
        if response_format is None:
            return None
        kind = response_format.get("type") if isinstance(response_format, dict) else response_format
        if kind == "text":
            return None
        if kind not in ("json_object", "json_schema"):
            raise GenerationError(
                f"response_format must be 'text', 'json_object' or 'json_schema', got {response_format!r}"
            )
        spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if kind == "json_schema" and not isinstance(schema, dict):
            raise GenerationError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        if self._json is None:  # the server builds these on its tokenizer threads: once, not once per thread
            with self._build_lock:
                if self._json is None:
                    self._json = JsonGrammar.from_tokenizer(self.tokenizer, self.model.vocab_size)
        if kind == "json_object":
            return self._json

        def build() -> JsonGrammar:
            try:
                return self._json.with_schema(schema)
            except ValueError as e:
                raise GenerationError(str(e)) from None

        return self._cached(self._schemas, json.dumps(schema, sort_keys=True), build)

    def get_drafter(
        self,
        drafter: Drafter | str | None = DEFAULT,
        heads: str | None | object = ...,
    ) -> Drafter | None:
        """'default' -> the engine's drafter; a registry name -> that drafter (built once, with load()'s heads
        unless ``heads`` is given); a drafter object -> itself; None -> plain decoding."""
        if drafter == DEFAULT:
            return self.engine.drafter
        if isinstance(drafter, str):
            return self.drafters.get(drafter, heads)
        if drafter is not None and not callable(getattr(drafter, "propose", None)):
            raise ValueError(
                f"drafter must be a drafter name, a drafter object (with propose) or None, got {drafter!r}"
            )
        return drafter

    def generate(
        self,
        prompt: str | list[dict],
        raw: bool = False,
        drafter: Drafter | str | None = DEFAULT,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        config: GenerationConfig | None = None,
        **kw,
    ) -> GenerationResult:
        """Generate a whole answer. kw: see :meth:`config` (or ``config``: one it made). ``tools`` / ``tool_choice``: OpenAI's function tools
        (:mod:`treedraft.tools`); a call comes back in ``tool_calls`` (``finish_reason`` "tool_calls", ``text``
        empty), a plain answer (tool_choice "auto") in ``text``; an answer cut by ``max_new_tokens`` keeps
        ``finish_reason`` "length" (a call's arguments then incomplete JSON: :func:`treedraft.tools.answer_message`)."""
        from .tools import (
            ToolRequestError,
            answer_format,
            answer_message,
            chat_dicts,
            parse_tools,
            render_messages,
            tool_mode,
        )

        _prompt_type(prompt)
        try:
            parsed = parse_tools(tools) if tools is not None else []
            mode = tool_mode(tool_choice, parsed)
            msgs = None  # without tools, encode_prompt reads the messages
            if mode is not None:
                msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else chat_dicts(prompt)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        if mode is None:
            ids = self.encode_prompt(prompt, raw)  # (first: a tokenizer-less LLM says so before its config fails)
            return self.text.generate(ids, self._config(config, kw), self.get_drafter(drafter))
        if config is not None:
            raise GenerationError("tools build the answer's config themselves: give keyword arguments, not config=")
        if raw:  # (ignored before: the tools' template applied anyway)
            raise GenerationError("raw=True takes no tools: the tools are given to the model through its chat template")
        try:
            fmt = answer_format(parsed, mode, kw.pop("stop", ()), kw.pop("response_format", None))
            cfg = self.config(**kw, response_format=fmt)
        except ToolRequestError as e:
            raise GenerationError(str(e)) from None
        except ValueError as e:
            raise GenerationError(f"tools: {e}") from None
        out = self.text.generate(
            self.encode_prompt(render_messages(msgs, parsed, mode)), cfg, self.get_drafter(drafter)
        )
        message, finish = answer_message(out.text, out.finish_reason, mode)
        return replace(out, text=message["content"] or "", finish_reason=finish, tool_calls=message.get("tool_calls"))

    def stream(
        self,
        prompt: str | list[dict],
        raw: bool = False,
        drafter: Drafter | str | None = DEFAULT,
        stats: GenerationStats | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        config: GenerationConfig | None = None,
        **kw,
    ) -> Iterator[Chunk]:
        """Yield chunks of text as they are produced (kw or ``config``: as :meth:`generate`). (Tools: :meth:`generate`, which returns the parsed call; the
        server streams tool calls.)"""
        if tools is not None or tool_choice is not None:
            raise GenerationError(
                "stream() takes no tools: use generate(..., tools=...), which returns the parsed tool calls "
                "(or the OpenAI-compatible server, which streams them)"
            )
        ids = self.encode_prompt(prompt, raw)  # (first, as in generate)
        return self.text.stream(ids, self._config(config, kw), self.get_drafter(drafter), stats)

    def _config(self, config: GenerationConfig | None, kw: dict) -> GenerationConfig:
        """``config`` (a :meth:`config` made earlier, reused across calls) or one made from ``kw``; not both."""
        if config is None:
            return self.config(**kw)
        if not isinstance(config, GenerationConfig):
            raise GenerationError(
                f"config must be a GenerationConfig (from llm.config(...)), got {type(config).__name__}"
            )
        if kw:
            raise GenerationError(
                f"give config= or generation keywords ({', '.join(sorted(kw))}), not both: llm.config(...) takes them"
            )
        return config


def _close_at_exit(ref: weakref.ref) -> None:
    llm = ref()
    if llm is not None:
        llm.close()


KV_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16}  # auto: see kv_dtype_for


def kv_dtype_for(kv_dtype: str, runtime: str, weights_info: dict | None) -> torch.dtype | None:
    """The KV cache dtype of a load (None: the weights' dtype): 'auto' stores float16 for int4/int8 weights.

    A decode step streams the cache as well as the weights: at a 512-token context an fp32 cache is 23.6 MB
    per step for SmolLM2 against 96 MB of int4 weights, and each concurrent request of the batched server
    streams its own (benchmarks/results/attn8.md: fp16 measured 1.07x faster at 1 row and 1.2x at 8
    requests x 1 row; top-1 agreement with an fp32 cache 0.98 over 299 teacher-forced positions, the same
    size as the int4 weights' own difference). llama.cpp's default cache is f16 too. fp32 weights keep an
    fp32 cache, so the exact fp32 path stays exact.
    """
    if kv_dtype != "auto":
        return KV_DTYPES[kv_dtype]
    resolved = (weights_info or {}).get("resolved")
    return torch.float16 if runtime == "own" and resolved in ("int4", "int8") else None


ATTN_SCORES = ("auto", "float32", "bf16")  # decode attention's q.k arithmetic (own runtime); auto: attn_scores_for


def check_attn_scores(attn_scores: str) -> None:
    """A clear error for a bad ``attn_scores`` value, before any slow load."""
    if attn_scores not in ATTN_SCORES:
        raise ValueError(f"attn_scores must be one of {list(ATTN_SCORES)}, got {attn_scores!r}")


def attn_scores_for(attn_scores: str, runtime: str, net: Any, path: Path | None, log=None) -> bool:
    """Whether the own runtime's decode attention computes q.k in bf16 (Transformer.bf16_scores).

    bf16 scores round q and k to bfloat16 and sum them with vdpbf16ps (exactly emulated off the AVX-512 path), so
    tree rows stay bitwise equal to the one-row step: greedy speculative output still equals plain decoding. The
    score pass of a multi-row step runs ~2x faster (benchmarks/attn_bf16_micro.cpp); teacher-forced top-1
    agreement with the fp32 model was unchanged against int4's own rounding (0.9737 with bf16 q and k, 0.9727 with
    the fp16 cache alone, on 2,890 MT-Bench positions, benchmarks/attn_precision.py). 'auto': bf16 for int4/int8 weights where the kernels have it
    (AVX512-BF16) and a tree step measured faster with it on this machine (cached); fp32 weights keep float32 scores,
    the exact reference. 'bf16' without the instructions: a ValueError saying so.
    """
    check_attn_scores(attn_scores)
    if attn_scores == "float32":
        return False
    from . import kernels

    if runtime != "own" or not hasattr(net, "bf16_scores") or not getattr(net, "exact_attention", False):
        if attn_scores == "bf16":
            raise ValueError(
                "attn_scores='bf16' needs the own runtime's native attention (int4/int8 weights on the CPU)"
            )
        return False
    if not kernels.bf16_scores_supported():
        if attn_scores == "bf16":
            raise ValueError(
                "attn_scores='bf16' needs a CPU with AVX512-BF16 (vdpbf16ps) for the native kernels; this one has "
                "none: use attn_scores='float32' or 'auto'"
            )
        return False
    if attn_scores == "bf16":
        return True
    resolved = (getattr(net, "weights_info", None) or {}).get("resolved")
    if resolved not in ("int4", "int8") or net.config.head_dim % 32:
        return False
    from .models.quant_load import choose_bf16_scores

    return choose_bf16_scores(net, path, log)


def freeze_gc() -> int:
    """Exempt every object alive now (model modules, tokenizer tables, drafters: ~335k objects for the default
    model) from Python's cyclic garbage collector (``gc.freeze``); returns how many are frozen.

    A full (generation 2) collection otherwise walks all of them: 75-200 ms with the GIL held, once every few
    seconds of decoding, a whole decode step's worth of stall many times over (on a 2.6 s, 8-request load-test
    level one such pause was a tenth of the wall time). For processes that load a model once and keep it: the
    CLI commands and the server call it after loading; a library user who loads and drops models should not
    (frozen objects are never collected).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def load(
    model: str = DEFAULT_MODEL,
    drafter: str | None = DEFAULT,
    heads: str | None = DEFAULT,
    device: str = "auto",
    dtype: str = "auto",
    runtime: str = "auto",
    max_seq_len: int | None = DEFAULT_MAX_SEQ_LEN,
    weights: str = "auto",
    suffix_store: str | None = None,
    suffix_max_tokens: int = DEFAULT_MAX_TOKENS,
    suffix_share: bool = False,
    suffix_max_total_tokens: int | None = None,
    kv_dtype: str = "auto",
    draft_model: str | None = None,
    draft_weights: str = "auto",
    attn_scores: str = "auto",
    threads: int | None = None,
) -> LLM:
    """Load a target model by registry name, GGUF path or HF directory.

    drafter: 'default' (hybrid-suffix: Medusa heads + prompt lookup + suffix branches from earlier outputs,
    when heads are shipped for this model or given, else prompt lookup; on fp32 weights of the own runtime on the
    CPU, and whenever ``draft_model`` is given, hybrid-draft: a draft model + suffix branches, the draft being the
    model's own GGUF in int4 unless ``draft_model`` names another; see ``drafters.registry.default_name``), a drafter
    name (see ``treedraft.drafters.names()``), or None / 'none' for plain decoding.
    heads: the Medusa heads / EAGLE drafter directory drafters that need one read ('default' or None: the ones
    shipped for this model; a directory ``treedraft train-heads`` / ``train-eagle`` wrote).
    max_seq_len: the context window (capped at the model's own, with a warning; None: the model's own).
    threads: CPU threads for the forwards (torch and the native kernels; the CLI's --threads); None: as they are.
    runtime: 'own' (the compact Llama-family module, Gemma 3 included), 'hf' (transformers adapter) or 'auto' (own
        where it runs the architecture).
    weights: 'fp32', 'int8', 'int4' (the GGUF's own 4-bit blocks) or 'auto' (the fastest measured on this
    machine whose quality check passes; see treedraft.models.quant_load). int4/int8: own runtime, cpu, fp32.
    suffix_store: directory where drafter ``suffix`` keeps earlier outputs across restarts (None: in memory,
    for this LLM's lifetime); suffix_max_tokens bounds what each tenant keeps (its own oldest requests are
    evicted, never another tenant's), suffix_max_total_tokens what the store keeps in all (the oldest requests of any
    tenant evicted; None: 16 x suffix_max_tokens); suffix_share lets every tenant draft from every other tenant's
    outputs (default: each tenant only from its own, see docs/drafters.md).
    kv_dtype: KV cache storage of the own runtime: 'float32', 'float16' (half the cache bytes per decode step;
    keys/values rounded to fp16, rows stay bitwise row-invariant; Transformer.kv_dtype) or 'auto' (float16
    with int4/int8 weights, else the weights' dtype; see :func:`kv_dtype_for`).
    attn_scores: the own runtime's decode attention arithmetic: 'float32', 'bf16' (q.k from bf16-rounded q and k, the
    score pass ~2x faster, rows still bitwise row-invariant; needs AVX512-BF16) or 'auto' (bf16 with int4/int8 weights
    where measured faster here; see :func:`attn_scores_for`).
    draft_model: the model drafter 'draft-model' drafts with (registry name, .gguf or HF directory sharing the
    target's tokenizer; None: the target's own file, packed in ``draft_weights``); giving one makes 'hybrid-draft'
    (the draft model with suffix chains) the default drafter. draft_weights: its weights, as ``weights`` ('auto':
    int4 on the CPU for a GGUF the own runtime runs, else dense in the target's dtype).
    """
    from .drafters.suffix import open_suffix_store
    from .drafters.suffix_store import tokenizer_fingerprint

    for name, value, none_ok in (("model", model, False), ("heads", heads, True), ("device", device, False)):
        if not (isinstance(value, (str, os.PathLike)) or (none_ok and value is None)):
            raise ValueError(f"{name} must be a {'string' if name == 'device' else 'name or path'}, got {value!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    check_attn_scores(attn_scores)
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2
    ):
        raise ValueError(f"max_seq_len must be an integer >= 2 (or None: the model's own context), got {max_seq_len!r}")

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an integer >= 1 (or None), got {threads!r}")
    if drafter is not None and not isinstance(drafter, str) and not callable(getattr(drafter, "propose", None)):
        raise ValueError(f"drafter must be a drafter name, a drafter object or None, got {drafter!r}")
    check_draft_args(draft_model, draft_weights, drafter)  # before the slow model load, as the drafter's name
    if draft_model is not None and drafter == DEFAULT:
        drafter = "hybrid-draft"  # a draft model given is the one to draft with (with suffix chains: registry)
    if isinstance(drafter, str):  # an unknown drafter name, or heads it needs and lacks, fail before the slow load
        name = canonical(drafter)
        check_files(
            name, DrafterOptions(model_name=model if not Path(model).exists() else str(resolve(model)), heads=heads)
        )
    store = open_suffix_store(suffix_store, suffix_max_tokens, suffix_share, suffix_max_total_tokens)  # before the load
    try:  # a load that fails lets go of the store's directory (a retry would find it held, with nothing to close)
        if threads is not None:
            from .cli import apply_threads

            apply_threads(threads)
        net, tok, path, dev = load_model(
            model, device, dtype, runtime, max_seq_len, weights, kv_dtype, attn_scores=attn_scores
        )
        # a store on disk holds token ids: refused when written under another tokenizer (its ids mean other tokens)
        if store.path is not None:
            store.bind_tokenizer(tokenizer_fingerprint(tok), net.vocab_size)
        own = getattr(net, "max_seq_len", None)
        if max_seq_len is not None and own is not None and own < max_seq_len and max_seq_len != DEFAULT_MAX_SEQ_LEN:
            warnings.warn(f"max_seq_len {max_seq_len} is more than {model}'s own context: using {own}", stacklevel=2)
        llm = LLM(
            Engine(net),
            tok,
            model if not Path(model).exists() else str(path),
            dev,
            heads,
            store,
            draft_model,
            draft_weights,
        )
        if drafter is not None:
            # a name through the registry ("default" included), a drafter object as it is
            llm.engine.drafter = llm.drafters.get(drafter) if isinstance(drafter, str) else drafter
            warn_unread_draft_args(draft_model, draft_weights, llm.engine.drafter)
            unread = [flag for flag, given in (("--heads / heads=", heads not in (None, DEFAULT)),
                                               ("--suffix-store / suffix_store=", suffix_store is not None),
                                               ("--suffix-max-tokens / suffix_max_tokens=", suffix_max_tokens != DEFAULT_MAX_TOKENS),
                                               ("--suffix-max-total-tokens / suffix_max_total_tokens=", suffix_max_total_tokens is not None),
                                               ("--suffix-share / suffix_share=", suffix_share)) if given]  # fmt: skip
            warn_unread_args(unread, llm.engine.drafter)
    except BaseException:
        store.close()
        raise
    atexit.register(_close_at_exit, weakref.ref(llm))  # flush + close the store (a weakref: llm may die first)
    return llm


DRAFT_MODEL_DRAFTERS = ("draft-model", "hybrid-draft")


def check_draft_args(draft_model: str | None, draft_weights: str, drafter: Any) -> None:
    """draft_model / draft_weights of :func:`load`, checked before any load: a draft model that does not resolve or
    unknown weights are a ValueError naming the argument (:func:`warn_unread_draft_args` looks at them after)."""
    from .models.quant import WEIGHTS

    if draft_weights not in WEIGHTS:
        raise ValueError(f"draft_weights (--draft-weights) must be one of {', '.join(WEIGHTS)}, got {draft_weights!r}")
    if draft_model is not None:
        try:
            resolve(draft_model)
        except ValueError as e:
            raise ValueError(f"draft model (--draft-model): {e}") from None


def warn_unread_draft_args(draft_model: str | None, draft_weights: str, drafter: Any) -> None:
    """Warn when draft_model / draft_weights were given and the loaded drafter does not read them (the server's
    requests may still pick draft-model by name; a load for plain decoding, drafter None, is left alone)."""
    name = getattr(drafter, "name", None)
    if drafter is None or (draft_model is None and draft_weights == "auto") or name in DRAFT_MODEL_DRAFTERS:
        return
    warnings.warn(
        f"--draft-model / --draft-weights are read by the drafters {' and '.join(DRAFT_MODEL_DRAFTERS)} only; this "
        f"load drafts with {name!r}, which ignores them (give --drafter draft-model or hybrid-draft)",
        stacklevel=3,
    )


def warn_unread_args(flags: list[str], drafter: Any) -> None:
    """Warn for each of ``flags`` (heads, suffix store settings) the loaded drafter does not read (a load for plain
    decoding, drafter None, is left alone: a server's requests may still name a drafter that reads them)."""
    from .drafters.registry import HEADS_DRAFTERS, SUFFIX_DRAFTERS

    name = getattr(drafter, "name", None)
    for flag in flags if drafter is not None else ():
        readers = HEADS_DRAFTERS if flag.startswith("--heads") else SUFFIX_DRAFTERS
        if name not in readers:
            warnings.warn(
                f"{flag} is read by the drafters {', '.join(readers)} only; this load drafts with {name!r}, which "
                "ignores it (a server's requests may still name one of those)",
                stacklevel=3,
            )


def load_tokenizer(path: Path, arch: str | None = None) -> Tokenizer:
    """The tokenizer of a resolved model path (a GGUF's, cached as files, or an HF directory's); ``arch``: its
    architecture when the caller has read it already."""
    from .models.loaders import GEMMA_ARCHS

    tok = (
        Tokenizer.from_gguf(path, cache_dir() / "tokenizers" / file_key(path))
        if path.is_file()
        else Tokenizer.from_dir(path)
    )
    if (arch or model_architecture(path)) in GEMMA_ARCHS and tok.hf.bos_token_id is not None:
        tok.add_bos = True  # Gemma expects <bos> in front of raw text
    return tok


def load_model(
    model: str = DEFAULT_MODEL,
    device: str = "auto",
    dtype: str = "auto",
    runtime: str = "auto",
    max_seq_len: int | None = DEFAULT_MAX_SEQ_LEN,
    weights: str = "auto",
    kv_dtype: str = "auto",
    tokenizer: Tokenizer | None = None,
    attn_scores: str = "auto",
) -> tuple[Any, Tokenizer, Path, str]:
    """A model and its tokenizer, without a drafter or an engine: (net, tokenizer, resolved path, device). What
    :func:`load` builds on, and what the ``draft-model`` drafter loads its draft model with; arguments as there.
    ``tokenizer``: the model's, when the caller has loaded it already (:func:`load_tokenizer`)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    check_attn_scores(attn_scores)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    path = resolve(model)
    from .models.loaders import GEMMA_ARCHS, ModelLoadError, own_runtime_loads

    arch = model_architecture(path)
    own_loads = own_runtime_loads(arch, path.is_dir())
    if runtime == "auto":
        runtime = "own" if own_loads else "hf"
    if arch in GEMMA_ARCHS and dt == torch.float16:  # its activations outgrow fp16's range (65504)
        warnings.warn(
            "Gemma 3 overflows in float16 (its residual stream exceeds fp16's range); use --dtype bf16 or fp32",
            stacklevel=3,  # the caller of load()
        )
    from .models.quant_load import resolve_weights  # --weights (issue 11): begin

    weights = resolve_weights(weights, runtime, dev, dt, own_loads)  # end
    if runtime == "hf" and kv_dtype != "auto":
        raise ValueError(
            f"kv_dtype {kv_dtype!r} (--kv-dtype) sets the own runtime's KV cache; the hf runtime keeps transformers' "
            "cache in the model's dtype: drop it"
            + (", or use runtime 'own' (--runtime own)" if own_loads else " (the own runtime does not run this model)")
        )
    if runtime == "own":
        net, _meta = load_own(path, dt, dev, max_seq_len)
        net.kv_dtype = KV_DTYPES[kv_dtype]
        if dev == "cpu" and weights == "fp32":  # int4/int8 replace every Linear; auto packs when fp32 wins
            pack_tuned(net, path, dt)  # per-row-count matmul kernels, measured on this machine
    elif runtime == "hf":
        from .models.hf_adapter import HFTarget

        net = HFTarget.load(path, dt, dev, max_seq_len)
    else:
        raise ModelLoadError(f"unknown runtime {runtime!r}; use auto, own or hf")
    tok = tokenizer or load_tokenizer(path, arch)
    if weights != "fp32":  # --weights (issue 11): swap in quantized linears; begin
        from .models.quant_load import PROBE_TEXT, apply_weights, log_stderr

        net.weights_info = apply_weights(net, path, weights, tok.encode(PROBE_TEXT), log=log_stderr)  # end
    if runtime == "own":  # after the weights are chosen: 'auto' follows them
        net.kv_dtype = kv_dtype_for(kv_dtype, runtime, getattr(net, "weights_info", None))
        from .models.quant_load import log_stderr

        net.bf16_scores = attn_scores_for(attn_scores, runtime, net, path, log_stderr)
    elif attn_scores == "bf16":
        attn_scores_for(attn_scores, runtime, net, path)  # raises: the hf runtime has no such attention
    return net, tok, path, dev
