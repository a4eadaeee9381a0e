"""`treedraft bench`: Spec-Bench-style benchmark of decoding methods side by side.

Modules, one concern each (the method protocol and the definitions of every figure are in :mod:`.harness`):

- :mod:`.harness`: prompts, the method protocol, :class:`EngineMethod`, :func:`run_bench` and its records;
- :mod:`.baselines`: transformers (:class:`HFMethod`) and llama.cpp (:class:`LlamaCppMethod`) methods;
- :mod:`.report`: summaries from the records, the Markdown report, plots, the machine a run ran on;
- :mod:`.cli`: ``treedraft bench`` (:func:`cmd_bench`, :func:`register`, :func:`build_methods`).
"""

from __future__ import annotations

from .baselines import HFMethod, LlamaCppMethod, llama_cpp_method, load_hf_baseline
from .cli import build_methods, cmd_bench, default_out_dir, known_methods, parse_methods, register
from .harness import (
    BASELINE_METHODS,
    BUILTIN_PROMPTS,
    DEFAULT_BASELINES,
    DEFAULT_DATASET,
    REFERENCE,
    BenchError,
    BenchPrompt,
    BenchResult,
    EngineMethod,
    Method,
    MethodOutput,
    Record,
    compare_outputs,
    find_default_dataset,
    load_prompts,
    make_record,
    run_bench,
    select_prompts,
)
from .report import (
    ALL_CATEGORIES,
    acceptance_per_depth,
    machine_info,
    markdown_report,
    mismatches,
    plot_accepted_hist,
    plot_speedup,
    summarize,
    throughput,
    write_report,
)

__all__ = [
    "ALL_CATEGORIES",
    "BASELINE_METHODS",
    "BUILTIN_PROMPTS",
    "DEFAULT_BASELINES",
    "DEFAULT_DATASET",
    "REFERENCE",
    "BenchError",
    "BenchPrompt",
    "BenchResult",
    "EngineMethod",
    "HFMethod",
    "LlamaCppMethod",
    "Method",
    "MethodOutput",
    "Record",
    "acceptance_per_depth",
    "build_methods",
    "cmd_bench",
    "compare_outputs",
    "default_out_dir",
    "find_default_dataset",
    "known_methods",
    "llama_cpp_method",
    "load_hf_baseline",
    "load_prompts",
    "machine_info",
    "make_record",
    "markdown_report",
    "mismatches",
    "parse_methods",
    "plot_accepted_hist",
    "plot_speedup",
    "register",
    "run_bench",
    "select_prompts",
    "summarize",
    "throughput",
    "write_report",
]
