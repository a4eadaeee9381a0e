"""`treedraft` command line: generate, chat, and the subcommands other modules register."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from typing import Any

# module -> name of its `register(subparsers)` function; loaded only if the module imports
_PLUGINS = ("treedraft.bench", "treedraft.server", "treedraft.training.cli", "treedraft.loadtest")
# plugins with optional dependencies (pyproject extras): module -> (its commands, the extra, the third-party modules
# they import, some only when a command runs). Where one is missing or broken the commands are still listed and
# say what to install, while every other command keeps working (a GPU image without fastapi ran `treedraft bench`
# into a ModuleNotFoundError from the server's import)
_OPTIONAL = {
    "treedraft.server": (("serve",), "server", ("fastapi", "uvicorn")),
    "treedraft.loadtest": (("loadtest",), "server", ("httpx",)),
}


def _installed(name: str) -> bool:
    """Whether module ``name`` can be imported (without importing it)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def add_model_args(
    p: argparse.ArgumentParser, drafting: bool = True, heads: bool = True, heads_help: str | None = None
) -> None:
    """Options shared by every command that loads a model; ``drafting``: --drafter, --max-seq-len and the suffix
    store's options, ``heads``: --heads (commands that train drafters or only generate data take neither: nothing
    would read them), described as ``heads_help`` says where the command reads only some of it."""
    from .api import DEFAULT_MAX_SEQ_LEN
    from .models.registry import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file or HF directory")
    from .drafters.registry import describe

    if drafting:
        p.add_argument("--drafter", default="default", help=describe())
    if heads:
        p.add_argument(
            "--heads",
            default="default",
            help=heads_help
            or "drafter weights directory: Medusa heads (medusa.json) and/or an EAGLE drafter (eagle.json) "
            "(default: the shipped ones)",
        )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on cpu, bf16 on cuda), fp32, bf16, fp16")
    p.add_argument(
        "--runtime",
        default="auto",
        help="own (compact Llama-family module, Gemma 3 too), hf (transformers), auto (own where it can)",
    )
    from .models.quant import WEIGHTS

    p.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHTS,
        help="linear weights on cpu: int4 (the GGUF's own 4-bit blocks), int8, fp32, or auto "
        "(fastest measured here whose quality check passes)",
    )
    add_kv_dtype_arg(p)
    if drafting:
        p.add_argument(
            "--max-seq-len",
            type=int,
            default=DEFAULT_MAX_SEQ_LEN,
            metavar="N",
            help=f"context window in tokens, prompt and answer together (default {DEFAULT_MAX_SEQ_LEN}; a larger value "
            "is capped at the "
            "model's own: 8192 for SmolLM2, 32768 for Gemma 3; the KV cache of a request grows with what it uses)",
        )
        add_suffix_args(p)
        add_draft_model_args(p)


def add_draft_model_args(p: argparse.ArgumentParser) -> None:
    """--draft-model / --draft-weights (drafter ``draft-model``), shared with bench."""
    from .models.quant import WEIGHTS

    p.add_argument(
        "--draft-model",
        default=None,
        metavar="MODEL",
        help="drafters draft-model / hybrid-draft: a smaller model sharing the target's tokenizer (registry name, "
        ".gguf or HF directory). Without it they draft with the target's own file in --draft-weights (int4 by "
        "default). Giving one makes hybrid-draft the default drafter; with --weights fp32 it is the default anyway",
    )
    p.add_argument(
        "--draft-weights",
        default="auto",
        choices=WEIGHTS,
        help="drafters draft-model / hybrid-draft: the draft model's weights (auto: int4 on the CPU for a GGUF the "
        "own runtime runs, else dense in the target's dtype)",
    )


def draft_kwargs(a: argparse.Namespace) -> dict:
    """load() keyword arguments from the --draft-* flags."""
    return dict(draft_model=a.draft_model, draft_weights=a.draft_weights)


def add_kv_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--kv-dtype and --attn-scores (own runtime), shared with bench."""
    from .api import ATTN_SCORES, KV_DTYPES

    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=sorted(KV_DTYPES),
        help="KV cache storage of the own runtime: auto (float16 with int4/int8 weights, else the weights' "
        "dtype), float32, float16",
    )
    p.add_argument(
        "--attn-scores",
        default="auto",
        choices=ATTN_SCORES,
        help="decode attention's q.k in the own runtime: float32, bf16 (q and k rounded to bfloat16, summed with "
        "vdpbf16ps: rows stay exact across tree sizes; needs AVX512-BF16), auto (bf16 with int4/int8 weights where "
        "measured faster on this machine)",
    )


def add_suffix_args(p: argparse.ArgumentParser) -> None:
    """--suffix-store / --suffix-max-tokens / --suffix-share (drafter ``suffix``), shared with bench and serve."""
    from .drafters.suffix_store import DEFAULT_MAX_TOKENS, TOTAL_PER_TENANT

    p.add_argument(
        "--suffix-store",
        default=None,
        metavar="DIR",
        help="drafters with suffix branches (suffix, hybrid-suffix, hybrid-eagle, hybrid-draft; the default is one "
        "where heads are shipped or on fp32 weights): keep "
        "earlier outputs in DIR across restarts (default: in memory)",
    )
    p.add_argument(
        "--suffix-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="drafters with suffix branches: tokens kept at most per tenant, that tenant's oldest requests evicted "
        f"first (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--suffix-max-total-tokens",
        type=int,
        default=None,
        metavar="N",
        help="drafters with suffix branches: tokens kept at most in all, the oldest requests of any tenant evicted "
        f"first (default {TOTAL_PER_TENANT} x --suffix-max-tokens)",
    )
    p.add_argument(
        "--suffix-share",
        action="store_true",
        help="drafters with suffix branches: every tenant drafts from every tenant's outputs (default: its own only; "
        "outputs stay exact, but speed would reveal what others generated)",
    )


def model_kwargs(a: argparse.Namespace) -> dict:
    """load() keyword arguments from add_model_args' device / dtype / runtime / weights / KV-cache / attention flags."""
    return dict(
        device=a.device,
        dtype=a.dtype,
        runtime=a.runtime,
        weights=a.weights,
        kv_dtype=a.kv_dtype,
        attn_scores=a.attn_scores,
    )


def suffix_kwargs(a: argparse.Namespace) -> dict:
    """load() keyword arguments from the --suffix-* flags."""
    return dict(
        suffix_store=a.suffix_store,
        suffix_max_tokens=a.suffix_max_tokens,
        suffix_share=a.suffix_share,
        suffix_max_total_tokens=a.suffix_max_total_tokens,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default; below 1e-5 too)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much mass (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below this fraction of the best one's probability (0 = off)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (the same seed, the same text)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--stop-token-id", action="append", type=int, default=[], help="a token id that ends the answer (repeatable)"
    )
    p.add_argument(
        "--rule",
        default="speculative",
        help="acceptance rule: speculative (lossless, the default), greedy (temperature 0 only), typical (lossy, "
        "sampling only)",
    )
    p.add_argument("--max-tree-nodes", type=int, default=64, help="draft tree size cap, root included (default 64)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="r > 0 on every token of the prompt and output so far: logit / r if positive, * r if not (1.0 = off)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, minus this for a token in the output")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, minus this x the token's count")
    p.add_argument("--min-tokens", type=int, default=0, help="no end of turn (EOS) before this many tokens")
    p.add_argument("--json", action="store_true", help="JSON mode: the answer is one JSON object")
    p.add_argument(
        "--json-schema", default=None, metavar="FILE", help="the answer is an object valid under this schema"
    )
    p.add_argument("--regex", default=None, help="the whole answer matches this regular expression (ECMA syntax)")
    p.add_argument("--choice", action="append", default=None, help="the answer is one of these strings (repeatable)")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """--threads for generate / chat (bench and serve define their own)."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of the model: the native kernels' pool and torch (default: torch's, i.e. all cores)",
    )


def apply_threads(n: int | None) -> None:
    """Use n CPU threads for the model's forwards (torch and the native kernels' pool); None: as they are."""
    if n is None:
        return
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    import torch

    from . import kernels

    torch.set_num_threads(n)
    kernels.set_num_threads(n)  # the pool takes torch's count only when the extension first loads


def load_from_args(a: argparse.Namespace):
    """The LLM the model flags name, loaded for this process's lifetime (its objects frozen out of the GC)."""
    from . import load
    from .api import freeze_gc

    apply_threads(getattr(a, "threads", None))

    llm = load(
        a.model,
        drafter=a.drafter,
        heads=a.heads,
        max_seq_len=a.max_seq_len,
        **model_kwargs(a),
        **suffix_kwargs(a),
        **draft_kwargs(a),
    )
    freeze_gc()
    return llm


def _gen_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        stop=a.stop,
        min_p=a.min_p,
        stop_token_ids=a.stop_token_id,
        rule=a.rule,
        max_tree_nodes=a.max_tree_nodes,
        repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        min_tokens=a.min_tokens,
        response_format=_response_format(a),
        prediction=_prediction(a),
        regex=a.regex,
        choice=a.choice,
    )


def _prediction(a: argparse.Namespace) -> str | None:
    """--prediction FILE's text (ValueError naming the file if it cannot be read)."""
    path = getattr(a, "prediction", None)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prediction {path}: {e}") from None


def _response_format(a: argparse.Namespace) -> str | dict | None:
    """--json / --json-schema FILE as a response_format (ValueError naming the file if it is not a JSON schema)."""
    if a.json_schema is None:
        return "json_object" if a.json else None
    import json

    try:
        with open(a.json_schema, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {a.json_schema}: {e}") from None
    from .grammar import compile_schema

    compile_schema(schema)  # unsupported keywords are reported before the model loads
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _run_stream(llm, prompt, kw: dict, raw: bool) -> str:
    from .engine import GenerationStats

    stats = GenerationStats()
    parts = []
    finish = None
    for ch in llm.stream(prompt, raw=raw, stats=stats, **kw):
        sys.stdout.write(ch.text)
        sys.stdout.flush()
        parts.append(ch.text)
        finish = ch.finish_reason or finish
    sys.stdout.write("\n")
    name = getattr(llm.engine.drafter, "name", "none") if llm.engine.drafter else "none"
    why = {"stop": " (ended)", "length": " (cut at the token limit)"}.get(finish, "")
    limit = kw.get("max_new_tokens")
    if finish == "length" and limit is not None and stats.new_tokens < limit:  # the context window cut it first
        why = " (cut at the context window: --max-seq-len)"
    print(
        f"[{stats.new_tokens} tokens{why}, {stats.tokens_per_s:.1f} tok/s, drafter {name}, "
        f"mean accepted {stats.mean_accepted_length:.2f}, prefill {stats.t_prefill * 1000:.0f} ms]",
        file=sys.stderr,
    )
    return "".join(parts)


def check_gen_args(a: argparse.Namespace, prompt: str | None = None) -> dict:
    """The generation keyword arguments of the flags (files read once, here); ValueError for bad sampling limits,
    constraints that exclude each other and an empty ``prompt``, before the slow model load."""
    from .engine import GenerationConfig
    from .penalties import Penalties
    from .sampling import SamplingParams

    given = _gen_kwargs(a)
    kw = dict(given)
    kw.pop("prediction")  # tokenized with the model
    regex, choice = kw.pop("regex"), kw.pop("choice")
    kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    constraints = [n for n, on in (("--json / --json-schema", kw.pop("response_format")), ("--regex", regex),
                                   ("--choice", choice)) if on]  # fmt: skip
    if len(constraints) > 1:
        raise ValueError(f"give one of {', '.join(constraints)}: each constrains the whole answer")
    if regex is not None or choice is not None:
        from .text_grammar import choice_pattern, full_match

        full_match(regex if choice is None else choice_pattern(choice))  # a bad expression: reported before the load
    for flag, on in (("--min-tokens", a.min_tokens), ("--stop-token-id", a.stop_token_id)):
        if constraints and on:  # GenerationConfig refuses these next to a grammar; said here before the load
            raise ValueError(f"{flag} cannot be combined with {constraints[0]} (the complete answer ends with EOS)")
    sampling = SamplingParams(kw.pop("temperature"), kw.pop("top_k"), kw.pop("top_p"), kw.pop("seed"), kw.pop("min_p"))
    penalties = Penalties(
        repetition=kw.pop("repetition_penalty"),
        presence=kw.pop("presence_penalty"),
        frequency=kw.pop("frequency_penalty"),
        min_tokens=kw.pop("min_tokens"),
    )
    GenerationConfig(sampling=sampling, penalties=penalties, **{**kw, "stop": tuple(kw["stop"])})  # validates
    if sampling.greedy:  # flags that only shape sampling: said, not silently ignored
        idle = [f for f, on in (("--top-k", a.top_k), ("--top-p", a.top_p != 1.0), ("--min-p", a.min_p),
                                ("--seed", a.seed is not None), ("--rule typical", a.rule == "typical")) if on]  # fmt: skip
        if idle:
            print(idle_sampling_note(idle), file=sys.stderr)
    if prompt is not None and not prompt.strip():
        raise ValueError("the prompt is empty; give some text")
    return given


def idle_sampling_note(flags: list[str]) -> str:
    """The note for sampling flags given to a greedy run (generate, chat, bench): said, not silently ignored."""
    return (
        f"note: {', '.join(flags)} only shape sampling; at temperature 0 (the default) decoding is greedy: "
        "give --temperature > 0 to sample"
    )


def cmd_generate(a: argparse.Namespace) -> int:
    if a.prompt == "-":  # a long prompt (a file to edit, say) from standard input, without the final newline(s)
        a.prompt = sys.stdin.read().rstrip("\n")  # (`echo q | treedraft generate -` asks what `generate q` asks)
    kw = check_gen_args(a, a.prompt)
    t = time.perf_counter()
    llm = load_from_args(a)
    print(f"[loaded {llm.model_name} in {time.perf_counter() - t:.1f}s]", file=sys.stderr)
    notes_after_load(a, llm)
    _run_stream(llm, a.prompt, kw, a.raw)
    return 0


def notes_after_load(a: argparse.Namespace, llm: Any) -> None:
    """What the loaded model or drafter makes of the flags, said rather than silently changed or ignored: a model
    without a chat template takes the prompt as raw text; --prediction is searched only by the drafters with prompt
    lookup or suffix branches; plain decoding reads no drafting flag (--max-tree-nodes, --heads, the suffix store's).
    """
    from .drafters.registry import PREDICTION_DRAFTERS
    from .drafters.suffix_store import DEFAULT_MAX_TOKENS

    name = getattr(llm.engine.drafter, "name", "none") if llm.engine.drafter is not None else "none"
    notes = []
    if not getattr(a, "raw", True) and llm.tokenizer is not None and not llm.tokenizer.is_chat:
        notes.append(f"{llm.model_name} has no chat template: the prompt is used as raw text (as with --raw)")
    if getattr(a, "prediction", None) and name not in PREDICTION_DRAFTERS:
        notes.append(
            f"--prediction is searched by the drafters {', '.join(PREDICTION_DRAFTERS)}; drafter {name!r} does not "
            "read it (the answer is the same, only not sped up by it)"
        )
    if name == "none":  # (load() warns only where a drafter was loaded: a server's requests may name one)
        given = [flag for flag, on in (("--max-tree-nodes", getattr(a, "max_tree_nodes", 64) != 64),
                                       ("--heads", getattr(a, "heads", None) not in (None, "default")),
                                       ("--suffix-store", getattr(a, "suffix_store", None) is not None),
                                       ("--suffix-max-tokens", getattr(a, "suffix_max_tokens", DEFAULT_MAX_TOKENS) != DEFAULT_MAX_TOKENS),
                                       ("--suffix-max-total-tokens", getattr(a, "suffix_max_total_tokens", None) is not None),
                                       ("--suffix-share", getattr(a, "suffix_share", False))) if on]  # fmt: skip
        if given:
            notes.append(f"{', '.join(given)}: plain decoding (drafter none) drafts nothing, so reads none of them")
    for n in notes:
        print(f"note: {n}", file=sys.stderr)


def fit_history(messages: list[dict], head: int, count: Callable[[list[dict]], int], limit: int) -> int:
    """Drop the oldest exchanges of a chat (a user message and the reply after it, behind the first ``head``
    messages: the system prompt) until ``count(messages)`` (the prompt's tokens) is at most ``limit``, never the last
    message; returns how many messages went. The caller reports what is still too long."""
    dropped = 0
    while len(messages) - head > 1 and count(messages) > limit:
        n = 2 if len(messages) - head > 2 else 1  # an exchange; (a lone earlier message: itself)
        del messages[head : head + n]
        dropped += n
    return dropped


CHAT_HELP = "treedraft chat: empty line or Ctrl-D to quit, /reset to clear the conversation, /help for this line"


def cmd_chat(a: argparse.Namespace) -> int:
    kw = check_gen_args(a)
    llm = load_from_args(a)
    notes_after_load(a, llm)
    if not llm.tokenizer.is_chat:
        print(f"error: {llm.model_name} has no chat template; use `treedraft generate --raw`", file=sys.stderr)
        return 2
    messages: list[dict] = [{"role": "system", "content": a.system}] if a.system else []
    head = len(messages)
    window = llm.model.max_seq_len
    # the prompt leaves the answer its --max-new-tokens where the window allows (at least one token)
    limit = max(window - 1 - (kw.get("max_new_tokens") or 0), min(window - 1, window // 2))
    print(CHAT_HELP, file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = messages[:head]
            continue
        if line.strip() == "/help":
            print(CHAT_HELP, file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:  # a message too long on its own: said, and the conversation kept (not dropped to make room for it)
            alone = len(llm.encode_prompt([*messages[:head], messages[-1]]))
        except ValueError as e:
            alone, why = window, str(e)
        else:
            why = f"this message alone takes {alone} of the window's {window} tokens (--max-seq-len); shorten it"
        if alone >= window:
            print(f"error: {why}", file=sys.stderr)
            messages.pop()
            continue
        dropped = fit_history(messages, head, lambda m: len(llm.encode_prompt(m)), limit)
        if dropped:
            print(
                f"[the conversation outgrew the context window ({window} tokens, --max-seq-len): "
                f"dropped its {dropped} oldest messages]",
                file=sys.stderr,
            )
        try:
            reply = _run_stream(llm, messages, kw, raw=False)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
    return 0


def _register_missing(sub: Any, mod: str, missing: str, why: str | None = None) -> None:
    """Stand-in commands for plugin ``mod`` whose optional dependency ``missing`` is not installed (or, ``why``,
    failed to import)."""
    names, extra, _ = _OPTIONAL[mod]
    reason = "which is not installed" if why is None else f"which failed to import ({why})"

    def fail(a: argparse.Namespace) -> int:
        print(
            f"error: `treedraft {a.command}` needs the Python package {missing!r}, {reason}; "
            f"install it with: pip install 'treedraft[{extra}]'",
            file=sys.stderr,
        )
        return 2

    for name in names:
        # no option prefix: whatever follows (--port 8000, -h) lands in `args` and the command says what is missing
        p = sub.add_parser(
            name,
            help=f"(unavailable: needs {missing!r}; pip install 'treedraft[{extra}]')",
            prefix_chars="\0",
            add_help=False,
        )
        p.add_argument("args", nargs="*")
        p.set_defaults(func=fail)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="treedraft", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt", help='the prompt; "-" reads it from standard input')
    g.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    g.add_argument(
        "--prediction",
        default=None,
        metavar="FILE",
        help="predicted output (OpenAI's predicted outputs): a text file the answer is expected to resemble, e.g. "
        "the code an edit rewrites; the text drafters draft from it too, the answer stays the same",
    )
    add_model_args(g)
    add_sampling_args(g)
    add_threads_arg(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    c.add_argument("--system", default=None, help="system prompt")
    add_model_args(c)
    add_sampling_args(c)
    add_threads_arg(c)
    c.set_defaults(func=cmd_chat)
    for mod in _PLUGINS:
        needs = _OPTIONAL[mod][2] if mod in _OPTIONAL else ()
        missing = next((d for d in needs if not _installed(d)), None)
        if missing is not None:  # (some are imported only when the command runs: checked here, by name)
            _register_missing(sub, mod, missing)
            continue
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("treedraft"):
                continue  # feature module not present in this build
            if mod not in _OPTIONAL:
                raise
            _register_missing(sub, mod, e.name or str(e))
            continue
        except ImportError as e:  # installed but broken (e.g. clashing versions): the other commands still work
            if mod not in _OPTIONAL:
                raise
            _register_missing(sub, mod, needs[0], str(e).splitlines()[0][:200])
            continue
        m.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    import warnings

    # a warning is one line on stderr, as errors are (not Python's file:line and source line)
    warnings.formatwarning = lambda message, category, *args, **kw: f"warning: {message}\n"
    a = build_parser().parse_args(argv)
    try:
        return int(a.func(a) or 0)
    except BrokenPipeError:  # the reader went away (`treedraft generate ... | head`): stop quietly, as cat does
        try:  # stdout to /dev/null, so that the interpreter's own flush at exit fails no more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # no file descriptor behind sys.stdout (captured)
            pass
        return 141
    except (ValueError, OSError) as e:  # user errors (bad values, paths that cannot be read or written): no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
