"""Where a served token's CPU time goes: server threads (event loop, model worker, kernel pool) and the client.

Starts ``treedraft serve`` on 127.0.0.1, then for each concurrency level runs ``treedraft loadtest`` (its own
process, fresh MT-Bench prompts per level: nothing answered from an earlier level's caches) and reads the
CPU time every server thread and the client spent during the level (``/proc/PID/task/*/stat``,
``wait4`` rusage). Printed per level: tok/s and CPU microseconds per completion token by thread, so a c8/c1
throughput ratio can be split into the forward's share and the per-token serving costs around it. On 2 cores
the client shares the machine with the server: its cost per token counts against the server's throughput.
``--trace``: the server also writes one line per step (``TREEDRAFT_STEP_TRACE``), and each level's steps are
split into prefill steps, full-batch steps and the tail (fewer requests than the level's concurrency), with the
mean step's forward, planning + drafting, acceptance and the rest (streaming hand-off, waiting for the GIL).

    python benchmarks/serve_cpu.py [--levels 1,8] [--requests 8] [--max-tokens 256] [--trace] [--] [serve args ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread of ``pid``, keyed 'name/tid' (the main thread: 'main')."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        key = "main" if int(tid) == pid else f"{name}/{tid}"
        out[key] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def wait_health(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    sys.exit("server did not become healthy")


def print_steps(steps: list[list[float]], concurrency: int) -> None:
    """A level's steps by kind: prefill (prompt rows in it), full batch, tail (fewer jobs than ``concurrency``)."""
    kinds: dict[str, list[list[float]]] = {}
    for i, st in enumerate(steps):
        period = steps[i + 1][0] - st[0] if i + 1 < len(steps) else st[1]  # start to the next step's start
        kind = "prefill" if st[4] > 0 else "full" if st[2] >= concurrency else "tail"
        kinds.setdefault(kind, []).append([period, *st[1:]])
    for kind, rows in kinds.items():
        n = len(rows)
        wall, in_step, fwd, plan, acc = (sum(r[i] for r in rows) for i in (0, 1, 6, 7, 8))
        tok, nrows = sum(r[5] for r in rows), sum(r[3] for r in rows)
        print(
            f"      {kind:>7}: {n:4d} steps, {wall:6.3f} s, {tok / wall if wall else 0:7.1f} tok/s; per step "
            f"{1e3 * wall / n:6.2f} ms = forward {1e3 * fwd / n:.2f} + plan/draft {1e3 * plan / n:.2f} + accept "
            f"{1e3 * acc / n:.2f} + rest {1e3 * (wall - fwd - plan - acc) / n:.2f}; rows {nrows / n:.1f}, "
            f"tokens {tok / n:.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--port", type=int, default=18777)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the levels (fresh prompts each time)")
    ap.add_argument("--trace", action="store_true", help="split each level's steps (TREEDRAFT_STEP_TRACE)")
    ap.add_argument("serve_args", nargs="*", help="extra `treedraft serve` arguments (after --)")
    a = ap.parse_args()
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    prompts = [json.loads(x) for x in open(REPO.parent / "shared/data/mt_bench_questions.jsonl")]
    tmp = Path(tempfile.mkdtemp(prefix="serve_cpu-"))
    trace = tmp / "steps.txt"
    if a.trace:
        env["TREEDRAFT_STEP_TRACE"] = str(trace)
    server = subprocess.Popen(
        [py, "-m", "treedraft.cli", "serve", "--weights", "int4", "--max-batch", "8", "--host", "127.0.0.1"]
        + ["--port", str(a.port), *a.serve_args],
        env=env,
        stdout=open(tmp / "server.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_health(a.port, server)
        levels = [int(x) for x in a.levels.split(",")] * a.rounds
        off = 0
        print(f"{'c':>3} {'tok/s':>7}  CPU us/token: " + "  ".join(["loop", "worker+pool", "other", "client", "total"]))
        for k, c in enumerate(levels):
            n = a.requests + (1 if k == 0 else 0)  # a warm-up request before the first level
            chosen = [prompts[(off + i) % len(prompts)] for i in range(n)]
            off += n
            pfile = tmp / f"prompts-{k}.jsonl"
            pfile.write_text("".join(json.dumps(p) + "\n" for p in chosen))
            before = thread_cpu(server.pid)
            traced = trace.stat().st_size if trace.exists() else 0
            out = tmp / f"lt-{k}"
            cmd = [py, "-m", "treedraft.cli", "loadtest", "--url", f"http://127.0.0.1:{a.port}"]
            cmd += ["--concurrency", str(c), "--requests", str(a.requests), "--max-tokens", str(a.max_tokens)]
            cmd += ["--ignore-eos", "--warmup", "1" if k == 0 else "0", "--prompts", str(pfile), "--out", str(out)]
            client = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            status = client.wait()
            after = thread_cpu(server.pid)
            if status != 0:
                sys.exit(f"loadtest failed (status {status}); see {out}")
            lv = json.loads((out / "loadtest.json").read_text())["levels"][0]
            tokens = lv["output_tokens"] + (a.max_tokens if k == 0 else 0)  # the warm-up's tokens ran too
            delta = {t: after[t] - before.get(t, 0.0) for t in after}
            loop = delta.pop("main", 0.0)
            worker = sum(v for t, v in delta.items() if t.startswith("td-worker"))  # its pool threads inherit the name
            other = sum(v for t, v in delta.items() if not t.startswith("td-worker"))
            client_cpu = lv["client_cpu_s"]  # during the level only (not the client's start-up)
            parts = [loop, worker, other, client_cpu, loop + worker + other + client_cpu]
            widths = [4, 11, 5, 6, 5]
            print(
                f"{c:>3} {lv['tokens_per_s']:>7.1f}                "
                + "  ".join(f"{1e6 * x / tokens:>{w}.0f}" for x, w in zip(parts, widths))
            )
            if a.trace and trace.exists():
                with open(trace) as f:
                    f.seek(traced)
                    print_steps([[float(x) for x in line.split()] for line in f], c)
            sys.stdout.flush()
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
