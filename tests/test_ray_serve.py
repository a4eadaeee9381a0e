"""Scale-out on Ray Serve (optional: ``pip install 'ray[serve]'``, ``make test-ray``).

A one-machine Ray cluster on 127.0.0.1 only (no dashboard, no usage reporting), Serve's proxy on
127.0.0.1, 2 replicas of the tiny model with 1 torch thread each, the official ``openai`` client:
requests spread over both replicas, greedy outputs equal the single-process engine's, API keys hold in
every replica, and a killed replica is replaced by Ray while a stream on the other one completes.
Every wait is bounded in time and every request loop in count.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import server_utils  # noqa: E402
import torch  # noqa: E402
from server_utils import metric, parse_metrics, tiny_llm, wait_for  # noqa: E402

from treedraft.cli import main  # noqa: E402
from treedraft.server import ServerSettings  # noqa: E402

try:
    import ray
    import ray.serve

    from treedraft.server import ray_serve as rs
except ImportError:
    ray = rs = None  # type: ignore[assignment]

needs_ray = pytest.mark.skipif(ray is None, reason="Ray is optional: pip install 'ray[serve]' (or `make test-ray`)")

KEY = "ray-key-0123456789"
PROMPTS = ["abc abc abc", "The quick brown fox", "hello hello", "1 2 3 4 5", "xyz xyz", "Once upon a time"]
CHAT = [{"role": "user", "content": "abc abc abc abc"}]
N_TOKENS = 24
LONG_TOKENS = 1500  # decoded plainly by the server: seconds on one thread, so the kill lands mid-stream
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def reference() -> dict:
    """Greedy outputs of the tiny model in this process (1 thread, like each replica)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = tiny_llm()

        def gen(ids: list[int], n: int) -> str:
            return llm.text.generate(
                ids, replace(llm.config(max_new_tokens=n), ignore_eos=True), llm.engine.drafter
            ).text

        out = {p: gen(llm.encode_prompt(p, raw=True), N_TOKENS) for p in PROMPTS}
        out["chat"] = gen(llm.encode_prompt(CHAT), N_TOKENS)
        out["long"] = gen(llm.encode_prompt(PROMPTS[0], raw=True), LONG_TOKENS)
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """Serve on a local 2-CPU cluster: 2 tiny-model replicas, 1 thread each, one API key."""
    # replicas unpickle tiny_llm by reference: they import server_utils from this directory
    tests_dir = os.path.dirname(os.path.abspath(server_utils.__file__))
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, old_path) if p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = ServerSettings(api_keys=(KEY,), poll_interval_s=0.05)
    with rs.local_cluster(num_cpus=2, object_store_mb=100):
        rs.run_app(
            rs.deployment(tiny_llm, settings, replicas=2, threads=1, log_level="WARNING"), "127.0.0.1", port, "WARNING"
        )
        yield f"http://127.0.0.1:{port}"
    if old_path is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old_path


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def complete(client: openai.OpenAI, prompt: str) -> tuple[str, str]:
    """(replica id, text) of one greedy completion."""
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=N_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return raw.headers[rs.REPLICA_HEADER], raw.parse().choices[0].text


def replica_metrics(url: str, replica: str, tries: int = 40) -> dict:
    """/metrics of one replica: the proxy picks a replica per request, so ask until that one answers."""
    for _ in range(tries):
        r = httpx.get(f"{url}/metrics", timeout=TIMEOUT)
        if r.headers[rs.REPLICA_HEADER] == replica:
            return parse_metrics(r.text)
    raise AssertionError(f"replica {replica} did not answer /metrics in {tries} tries")


def spread(client: openai.OpenAI, reference: dict, want: set[str], rounds: int = 6) -> set[str]:
    """Rounds of concurrent greedy completions (each checked against the reference) until every replica
    in ``want`` has answered; returns the replicas seen."""
    seen: set[str] = set()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        for _ in range(rounds):
            for p, (rid, text) in zip(PROMPTS, pool.map(lambda p: complete(client, p), PROMPTS)):
                assert text == reference[p], (rid, p)
                seen.add(rid)
            if want <= seen:
                break
    return seen


def test_serve_ray_without_ray_names_the_pip_command(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for mod in ("ray", "ray.serve", "treedraft.server.ray_serve"):
        monkeypatch.setitem(sys.modules, mod, None)  # import fails as if Ray were not installed
    assert main(["serve", "--ray", "--replicas", "2", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "needs Ray Serve" in err and "pip install 'ray[serve]'" in err, err
    assert main(["serve", "--replicas", "2", "--model", "no-such-model"]) == 2  # Ray flags without --ray
    assert "need --ray" in capsys.readouterr().err


@needs_ray
def test_serve_run_builder_takes_the_serve_flags() -> None:
    """``serve run treedraft.server.ray_serve:app_builder key=value ...`` builds what ``serve --ray`` would."""
    app = rs.app_builder(
        {"model": "m", "replicas": "3", "threads": "2", "api-key": f"{KEY},{KEY}x", "protect_health_metrics": "true"}
    )
    dep = app._bound_deployment  # no public accessor; checked against Ray 2.60
    loader, settings, threads = dep.init_args
    assert (dep.num_replicas, dep.ray_actor_options["num_cpus"], threads) == (3, 2.0, 2)
    assert settings.api_keys == (KEY, f"{KEY}x") and settings.protect_health_metrics
    assert loader.args[0].model == "m"
    with pytest.raises(ValueError, match="--suffix-store"):
        rs.app_builder({"model": "m", "replicas": "2", "suffix_store": "/tmp/x"})


@needs_ray
@pytest.mark.ray
def test_requests_spread_and_match_single_process(url: str, client: openai.OpenAI, reference: dict) -> None:
    replicas = set(rs.replica_actors())
    assert len(replicas) == 2, replicas
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "abc"}, timeout=TIMEOUT)
    assert r.status_code == 401 and r.headers[rs.REPLICA_HEADER] in replicas, r.text  # keys hold in the replicas
    assert spread(client, reference, replicas) == replicas  # both replicas answered, every output exact
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=N_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference["chat"]
    m = httpx.get(f"{url}/metrics", timeout=TIMEOUT)
    assert f'treedraft:replica_info{{model_name="tiny",replica="{m.headers[rs.REPLICA_HEADER]}"}} 1.0' in m.text
    # a client that leaves mid-stream: the proxy passes the disconnect on and the replica frees the slot
    body = {"prompt": "abc", "max_tokens": 3000, "stream": True, "ignore_eos": True, "treedraft": {"drafter": "plain"}}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=TIMEOUT) as r:
        rid = r.headers[rs.REPLICA_HEADER]
        assert next(r.iter_lines()).startswith("data: ")
    wait_for(
        lambda: (
            metric(ms := replica_metrics(url, rid), "treedraft:request_aborted_total") == 1
            and metric(ms, "treedraft:num_requests_running") == 0
        ),
        "the replica to drop the abandoned stream",
        TIMEOUT,
    )


@needs_ray
@pytest.mark.ray
def test_killed_replica_is_replaced_while_a_stream_elsewhere_completes(client: openai.OpenAI, reference: dict) -> None:
    with client.completions.with_streaming_response.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=LONG_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "treedraft": {"drafter": "plain"}},
    ) as resp:
        survivor = resp.headers[rs.REPLICA_HEADER]
        actors = rs.replica_actors()
        (victim,) = set(actors) - {survivor}
        chunks = iter(resp.parse())
        parts = [next(chunks).choices[0].text]  # the stream is open on the survivor
        ray.kill(ray.get_actor(actors[victim], namespace=rs.SERVE_NAMESPACE), no_restart=True)
        wait_for(lambda: victim not in rs.replica_actors(), "the killed replica's actor to go", TIMEOUT)
        finish = None
        for c in chunks:
            parts.append(c.choices[0].text)
            finish = c.choices[0].finish_reason or finish
    assert "".join(parts) == reference["long"] and finish == "length"  # plain decoding, same greedy text
    wait_for(
        lambda: len(rs.replica_actors()) == 2 and rs.running_replicas() == 2, "a replacement replica to run", TIMEOUT
    )
    (new,) = set(rs.replica_actors()) - {survivor}
    assert new != victim
    assert new in spread(client, reference, {new})  # the replacement serves, with the same outputs
