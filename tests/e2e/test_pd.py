"""AFD as the decode stage of a prefill/decode deployment (docs/pd.md), as real `vllm serve`
processes: an ordinary vLLM server prefills (KV producer), an AFD 1A1F deployment decodes
(its attention server the KV consumer), both through vLLM's ExampleConnector (KV blocks as
files in a shared folder). The test routes each request itself, as vLLM's own P/D proxies
do: the prompt to the prefill server with max_tokens=1, then the whole request to the
decode server, which loads the prompt's whole blocks and computes only the rest.

One deployment (a colocated reference server, the prefill server, the AFD pair) answers
every test: one request at a time, then two as one batch with DBO m = 2 (the step that
loads KV runs unsplit, the decode steps in two micro-batches of one request each). The
greedy tokens and their logprobs are the colocated server's (equal in both runs), and the
decode server's own counters show the KV came from the connector: vLLM's prompt tokens by
source (`external_kv_transfer`: every whole block below the last prompt token) and the
consumer's "Inject KV cache" log lines (logged before ExampleConnector looks at the step's
forward context, so they alone do not prove a load).

Then the same requests through `afd pd-router` (in this process); a second decode
deployment, 2A1F (two data-parallel attention ranks), loading the KV on either rank; and at
the end of the module, failures through the router: the FFN server killed while a request decodes (the attention
server's 500 reaches the client, timed), then the prefill server killed (the router's 502,
timed).

qwen3_moe (CPU_ATTN, block size 32, its unit), fp32.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from afd_plugin.deploy.servers import (
    SHARED_CORES,
    Server,
    ServerSpec,
    afd_steps,
    complete,
    free_port,
    local_deployment,
    post,
    running,
)
from tests.e2e.conftest import DBO_ARGS, DEV_MODE, rpc

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"
BLOCK = 32
MAX_TOKENS = 12
# 134 and 94 tokens with the tiny tokenizer: 4 and 2 whole KV blocks load (the test checks)
PROMPTS = [
    "The attention servers keep the KV cache of every request, while the feed-forward "
    "servers hold the experts and serve every layer's MoE for the rows they are sent; a "
    "prefill server computes the prompt once and hands its blocks to the decode stage.",
    "Numbers and letters 0 1 2 3 4 5 6 7 8 9 a b c d e f g h i j k l m n o p q r s t u v "
    "w x y z, then the quick brown fox jumps over the lazy dog twice, and once more slowly.",
]
ARGS = ["--block-size", str(BLOCK)]


def kv_config(role: str, storage) -> list[str]:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    return ["--kv-transfer-config", json.dumps(config)]


def loaded_tokens(prompt_tokens: int) -> int:
    """The tokens ExampleConnector loads for a prompt: the whole blocks below its last token
    (the decode server computes that one and any partial block)."""
    return (prompt_tokens - 2) // BLOCK * BLOCK


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """vLLM's prompt tokens by source, summed over the server's engines (one per DP rank)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_by_source_total":
                out[s.labels["source"]] = out.get(s.labels["source"], 0.0) + s.value
    return out


def injected(server) -> list[int]:
    """Tokens per "Inject KV cache" line of the consumer's log (ExampleConnector's worker)."""
    log = server.log_path.read_text(errors="replace")
    return [int(n) for n in re.findall(r"Inject KV cache of (\d+) tokens", log)]


@pytest.fixture(scope="module")
def pd(checkpoints, log_dir, tmp_path_factory):
    model = str(checkpoints(ARCH))
    storage = tmp_path_factory.mktemp("kv-storage")
    reference = Server(
        ServerSpec(f"{ARCH}-pd-reference", model, free_port(), env=SHARED_CORES, extra_args=ARGS),
        log_dir,
    )
    prefill = Server(
        ServerSpec(
            f"{ARCH}-pd-prefill",
            model,
            free_port(),
            env=SHARED_CORES,
            extra_args=ARGS + kv_config("kv_producer", storage),
        ),
        log_dir,
    )
    # prefix caching off: a prompt seen before loads from the connector again, not from
    # the decode server's own cache
    decode_args = ARGS + ["--no-enable-prefix-caching"] + kv_config("kv_consumer", storage)
    d = local_deployment(
        model,
        log_dir,
        attention_args=DBO_ARGS + decode_args,
        env=DEV_MODE,
        tag=f"{ARCH}-pd-decode-",
    )
    d["attention"].spec.log_stats = True  # vLLM's prompt tokens by source
    with running([reference, prefill, d["ffn"], d["attention"]]):
        counts = [
            post(reference.url, "/tokenize", {"model": "tiny", "prompt": p})["count"]
            for p in PROMPTS
        ]
        for n in counts:  # whole blocks move, and ExampleConnector finds what it saved
            assert n > 2 * BLOCK + 1 and (n - 1) % BLOCK, counts
        alone = [complete(reference.url, p, MAX_TOKENS) for p in PROMPTS]
        yield SimpleNamespace(
            prefill=prefill,
            decode=d["attention"],
            ffn=d["ffn"],
            counts=counts,
            alone=alone,
            model=model,
            storage=storage,
        )


def prefill_then_decode(pd, batch: bool = False):
    """Each prompt to the prefill server (max_tokens=1), then to the decode server: one
    request at a time, or all as one batch (vLLM's dev endpoints pause the scheduler while
    they are added)."""
    from afd_plugin.deploy.servers import complete_batch

    for p in PROMPTS:
        complete(pd.prefill.url, p, 1)
    if batch:
        return complete_batch(pd.decode.url, PROMPTS, MAX_TOKENS)[0]
    return [complete(pd.decode.url, p, MAX_TOKENS) for p in PROMPTS]


def assert_colocated_tokens(reference, got, tol: float = 1e-5):
    for prompt, ref, out in zip(PROMPTS, reference, got, strict=True):
        assert len(out.token_ids) == MAX_TOKENS
        assert out.token_ids == ref.token_ids, prompt
        worst = max(abs(a - b) for a, b in zip(ref.logprobs, out.logprobs, strict=True))
        assert worst <= tol, (prompt, worst)


def assert_loaded_from_the_connector(pd, before: dict, inject_before: int):
    after = prompt_tokens_by_source(pd.decode.url)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    loaded = [loaded_tokens(n) for n in pd.counts]
    assert delta["external_kv_transfer"] == sum(loaded), delta
    assert delta["local_compute"] == sum(pd.counts) - sum(loaded), delta
    assert delta["local_cache_hit"] == 0, delta
    assert sorted(injected(pd.decode)[inject_before:]) == sorted(loaded)


def test_afd_decodes_what_an_ordinary_prefill_server_prefilled(pd):
    before, inject_before = prompt_tokens_by_source(pd.decode.url), len(injected(pd.decode))
    got = prefill_then_decode(pd)
    assert_colocated_tokens(pd.alone, got)
    assert_loaded_from_the_connector(pd, before, inject_before)
    (stats,) = rpc(pd.decode.url, "afd_step_stats")
    assert stats["failed"] == 0 and stats["steps"] > 0, stats


def batch_with_microbatches(pd, m: str):
    """Both prompts as one batch with the decode server at `m`, then back at 1: (the
    outputs, the steps run by number of micro-batches, the KV counters before)."""
    rpc(pd.decode.url, "afd_set_microbatching", m)
    try:
        before, inject_before = prompt_tokens_by_source(pd.decode.url), len(injected(pd.decode))
        split_before = rpc(pd.decode.url, "afd_step_stats")[0]["by_microbatches"]
        got = prefill_then_decode(pd, batch=True)
        split = rpc(pd.decode.url, "afd_step_stats")[0]["by_microbatches"]
    finally:
        rpc(pd.decode.url, "afd_set_microbatching", "1")
    ran = {k: n - split_before.get(k, 0) for k, n in split.items() if n != split_before.get(k)}
    return got, ran, (before, inject_before)


def test_with_dbo_the_loading_step_runs_whole_and_decode_steps_split(pd):
    got, ran, (before, inject_before) = batch_with_microbatches(pd, "2")
    # the step that loaded both prompts' KV (and sampled their first tokens) ran whole; the
    # decode steps of the two requests as two micro-batches of one request each, compared
    # with each request run alone (vLLM's CPU path is not batch-invariant). A split loading
    # step would load nothing (ExampleConnector skips a split step's forward context, after
    # logging its "Inject KV cache" line): the tokens show it.
    assert ran == {"1": 1, "2": MAX_TOKENS - 1}, ran
    assert_colocated_tokens(pd.alone, got)
    assert_loaded_from_the_connector(pd, before, inject_before)


def test_with_auto_microbatches_the_kv_loads_and_every_request_completes(pd):
    """num_microbatches "auto" on the decode server: each step's m is the tuner's (1 or 2
    here, measured per step); the step that loads the KV still runs whole, and the
    requests get the colocated tokens (two requests, each alone when split; this tiny
    Qwen3-MoE batch of two computes what each computes alone on CPU, checked below)."""
    got, ran, (before, inject_before) = batch_with_microbatches(pd, "auto")
    assert sum(ran.values()) == MAX_TOKENS and ran.get("1", 0) >= 1, ran
    assert_colocated_tokens(pd.alone, got)
    assert_loaded_from_the_connector(pd, before, inject_before)


# -- through afd pd-router ------------------------------------------------------------------


@pytest.fixture(scope="module")
def router(pd):
    from afd_plugin.deploy.pd_router import RouterConfig, RunningRouter

    config = RouterConfig(prefill=(pd.prefill.url,), decode=(pd.decode.url,), port=0)
    with RunningRouter(config) as r:
        yield r


def test_through_the_router_the_tokens_are_colocated(pd, router):
    with urllib.request.urlopen(router.url + "/health", timeout=30) as r:
        health = json.loads(r.read())
    assert health == {"prefill": {pd.prefill.url: 200}, "decode": {pd.decode.url: 200}}
    before, inject_before = prompt_tokens_by_source(pd.decode.url), len(injected(pd.decode))
    got = [complete(router.url, p, MAX_TOKENS) for p in PROMPTS]
    assert_colocated_tokens(pd.alone, got)
    assert_loaded_from_the_connector(pd, before, inject_before)


def test_afd_launch_starts_the_router_of_a_pd_spec(pd, tmp_path):
    """`afd launch SPEC --host r` of a P/D spec whose servers are this module's (host a,
    127.0.0.1, already running) and whose router runs on host r (127.0.0.2): it starts the
    router alone, reports it up once every backend is healthy, and serves the colocated
    tokens through it; Ctrl-C stops it."""
    import subprocess
    import sys

    router_port = free_port()
    spec = {
        "model": pd.model,
        "platform": "cpu",
        "rendezvous_port": pd.ffn.spec.afd["port"],
        "hosts": {"a": {"address": "127.0.0.1"}, "r": {"address": "127.0.0.2"}},
        "servers": [
            {"name": "ffn0", "role": "ffn", "port": pd.ffn.spec.port, "hosts": "a"},
            {
                "name": "attention0",
                "role": "attention",
                "port": pd.decode.spec.port,
                "hosts": "a",
                "args": kv_config("kv_consumer", pd.storage),
            },
            {
                "name": "prefill0",
                "role": "prefill",
                "port": pd.prefill.spec.port,
                "hosts": "a",
                "args": kv_config("kv_producer", pd.storage),
            },
        ],
        "router": {"host": "r", "port": router_port},
    }
    path = tmp_path / "pd.toml"
    path.write_text(toml(spec))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "afd_plugin.cli", "launch", str(path), "--host", "r",
         "--log-dir", str(tmp_path / "logs"), "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("all up"):
                break
        assert lines and lines[-1].startswith("all up"), "".join(lines)
        up = time.monotonic() - t0
        assert f"router serves at http://127.0.0.2:{router_port}" in "".join(lines)
        got = [complete(f"http://127.0.0.2:{router_port}", p, MAX_TOKENS) for p in PROMPTS]
        assert_colocated_tokens(pd.alone, got)
        print(f"afd launch --host r: the router up in {up:.1f} s")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(30)
    assert rc == 130


def toml(spec: dict) -> str:
    """A deployment spec as TOML (strings, integers, lists, tables of them)."""

    def value(v):
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)

    out = [f"{key} = {value(v)}" for key, v in spec.items() if key != "servers"]
    for s in spec["servers"]:
        out.append("[[servers]]")
        out += [f"{k} = {value(x)}" for k, x in s.items()]
    return "\n".join(out) + "\n"


# -- a decode server of two data-parallel attention ranks (2A1F) ---------------------------


def test_a_2a1f_decode_server_loads_the_kv_on_either_data_parallel_rank(pd, log_dir):
    """The decode stage as an attention server of two DP ranks and one FFN server: each
    prompt prefilled by the module's prefill server, then decoded on DP rank 0 and on DP
    rank 1 (vLLM's X-data-parallel-rank header), then once more through `afd pd-router`
    (vLLM's balancer picks the rank). Every answer has the colocated tokens, and every
    whole block came from the connector, summed over both ranks' counters."""
    from afd_plugin.deploy.pd_router import RouterConfig, RunningRouter

    decode_args = ARGS + ["--no-enable-prefix-caching"] + kv_config("kv_consumer", pd.storage)
    d = local_deployment(
        pd.model,
        log_dir,
        attention_ranks=2,
        attention_args=decode_args,
        env=DEV_MODE,
        tag=f"{ARCH}-pd-decode-2a1f-",
    )
    d["attention"].spec.log_stats = True
    decode = d["attention"]
    loaded = [loaded_tokens(n) for n in pd.counts]
    with running([d["ffn"], decode]):
        for rank in (0, 1):
            before = prompt_tokens_by_source(decode.url)
            for p in PROMPTS:
                complete(pd.prefill.url, p, 1)
            got = [complete(decode.url, p, MAX_TOKENS, data_parallel_rank=rank) for p in PROMPTS]
            assert_colocated_tokens(pd.alone, got)
            after = prompt_tokens_by_source(decode.url)
            delta = {k: after[k] - before.get(k, 0) for k in after}
            assert delta["external_kv_transfer"] == sum(loaded), (rank, delta)
            assert delta["local_compute"] == sum(pd.counts) - sum(loaded), (rank, delta)
        config = RouterConfig(prefill=(pd.prefill.url,), decode=(decode.url,), port=0)
        with RunningRouter(config) as r:
            got = [complete(r.url, p, MAX_TOKENS) for p in PROMPTS]
        assert_colocated_tokens(pd.alone, got)
        steps = afd_steps(decode.url)
        assert set(steps) == {0, 1} and min(steps.values()) > 0, steps


# -- failures (these end the deployment: last in the module) ---------------------------------


def _post_router(router, prompt: str, max_tokens: int, timeout: float = 120.0):
    """(status, JSON answer, seconds) of one completion through the router."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    req = urllib.request.Request(
        router.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    return status, json.loads(text), time.monotonic() - t0


def test_a_killed_ffn_server_fails_the_routed_request_with_the_attention_servers_500(pd, router):
    """The FFN server killed while a routed request streams its tokens: the stream ends
    with an error, not a hang; then a new routed request gets the attention server's 500
    through the router."""
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 300, "ignore_eos": True}
    req = urllib.request.Request(
        router.url + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events, killed_at = [], None
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        try:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                events.append(line[6:].strip())
                if len(events) == 5:  # mid-decode
                    killed_at = time.monotonic()
                    os.killpg(pd.ffn.proc.pid, signal.SIGKILL)
        except (OSError, http.client.HTTPException):
            events.append(b"(the connection broke)")
    assert killed_at is not None, events
    in_flight = time.monotonic() - killed_at
    tokens = [e for e in events if e.startswith(b"{") and b'"choices"' in e]
    assert len(tokens) < 300 and any(b"error" in e or b"broke" in e for e in events), events[-3:]
    status, answer, seconds = _post_router(router, PROMPTS[1], MAX_TOKENS)
    print(
        f"FFN server killed: the streamed routed request ended with {events[-2:]} "
        f"{in_flight:.2f} s after the kill, after {len(tokens)} token events; a new routed "
        f"request failed in {seconds:.2f} s ({status}: {answer})"
    )
    assert in_flight < 30, in_flight
    assert status == 500 and seconds < 30, (status, answer, seconds)


def test_a_killed_prefill_server_fails_the_routed_request_quickly(pd, router):
    os.killpg(pd.prefill.proc.pid, signal.SIGKILL)
    pd.prefill.proc.wait(30)
    status, answer, seconds = _post_router(router, PROMPTS[1], MAX_TOKENS)
    print(f"prefill server killed: the routed request failed in {seconds:.3f} s ({status})")
    assert status == 502, answer
    assert answer["error"]["stage"] == "prefill" and pd.prefill.url in answer["error"]["message"]
    assert seconds < 5, seconds
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(router.url + "/health", timeout=30)
    assert exc.value.code == 503
