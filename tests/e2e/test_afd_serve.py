"""Real `vllm serve` processes: AFD gives exactly the tokens the colocated server gives,
with and without micro-batches (DBO), and survives a failed step.

Per architecture: a colocated server with a 1 attention : 1 FFN deployment, then one
attention server with two data-parallel ranks and one FFN server (2A1F for DeepSeek-V2, its
attention ranks stepping independently: async DP; 2A2F for Qwen3-MoE, its FFN server's two
data-parallel ranks one expert group, so its attention ranks in lockstep); each deployment is
started once and answers several tests. fp32 greedy. The attention servers start
DBO-capable and change m at run time through vLLM's dev endpoint, so one deployment answers
m = 1, 2 and 4.

vLLM's CPU path is not batch-invariant (DeepSeek-V2: the same request's logprobs move by up
to 1.2 between a lone run and a batch of four), so each micro-batched run is compared with
the run whose batches are its micro-batches: four micro-batches of one request each against
the requests run alone, two of two against the two pairs run as batches. Equal batches
compare exactly (max logprob difference 1e-5), colocated or AFD.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from afd_core.step.tuner import WARMUP_STEPS, WINDOW
from afd_plugin.deploy.servers import (
    SHARED_CORES,
    Server,
    ServerError,
    ServerSpec,
    complete,
    free_port,
    local_deployment,
    running,
)
from tests.e2e.conftest import (
    BACKENDS,
    DBO_ARGS,
    DEV_MODE,
    MAX_TOKENS,
    PROMPTS,
    assert_same,
    rpc,
    run_batch,
    run_prompts,
    steps_on_one_rank,
)
from tests.e2e.conftest import (
    COLOCATED_ALONE as _ALONE,
)

pytestmark = pytest.mark.e2e


STEP_TIMEOUT_S = 30  # connector timeout_s: a hang would fail within this


def afd_pair(model, arch, log_dir, tag, dp=1, env=None, ffn_ranks=1, afd_extra=None):
    d = local_deployment(
        model,
        log_dir,
        attention_ranks=dp,
        ffn_ranks=ffn_ranks,
        attention_backend=BACKENDS[arch],
        attention_args=DBO_ARGS,
        env={**DEV_MODE, **(env or {})},
        afd_extra={"connector_extra_config": {"timeout_s": STEP_TIMEOUT_S}, **(afd_extra or {})},
        tag=f"{arch}-{tag}-",
    )
    return d["ffn"], d["attention"]


def colocated_server(model, arch, log_dir):
    spec = ServerSpec(
        f"{arch}-colocated",
        model,
        free_port(),
        attention_backend=BACKENDS[arch],
        env={**SHARED_CORES, **DEV_MODE},
    )
    return Server(spec, log_dir)


@pytest.fixture(scope="module", params=list(BACKENDS))
def one_to_one(request, checkpoints, log_dir):
    """Colocated server and a 1A1F deployment of one architecture, for the whole module."""
    arch = request.param
    model = str(checkpoints(arch))
    colocated = colocated_server(model, arch, log_dir)
    trace = str(log_dir / f"{arch}-1a1f-trace")  # step timelines, for `afd bench`
    ffn, att = afd_pair(model, arch, log_dir, "1a1f", env={"AFD_STEP_TRACE": trace})
    servers = [colocated, ffn, att]  # a test may add a restarted server: stopped too
    with running(servers):
        _ALONE[arch] = run_prompts(colocated.url)
        yield SimpleNamespace(
            arch=arch,
            model=model,
            trace=trace,
            colocated=colocated,
            ffn=ffn,
            att=att,
            servers=servers,
        )


def set_m(att, m: int | str, decode_threshold: int | None = None) -> dict:
    args = [str(m)] + ([str(decode_threshold)] if decode_threshold else [])
    return rpc(att.url, "afd_set_microbatching", *args)[0]


def split_steps(att) -> dict:
    return rpc(att.url, "afd_step_stats")[0]["by_microbatches"]


def delta(after: dict, before: dict) -> dict:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def test_1a1f_without_microbatches_matches_colocated(one_to_one):
    d = one_to_one
    set_m(d.att, 1)
    assert_same(_ALONE[d.arch], run_prompts(d.att.url))
    assert_same(run_batch(d.colocated.url), run_batch(d.att.url))  # the same batch of four


def test_microbatches_compute_exactly_what_their_requests_compute(one_to_one):
    d = one_to_one
    set_m(d.att, 1)
    pairs = run_batch(d.att.url, PROMPTS[:2]) + run_batch(d.att.url, PROMPTS[2:])
    before = split_steps(d.att)
    set_m(d.att, 4)  # four micro-batches of one request each
    assert_same(_ALONE[d.arch], run_batch(d.att.url))
    set_m(d.att, 2)  # two micro-batches: the first two requests and the last two
    assert_same(pairs, run_batch(d.att.url))
    # every step of both batches was split: the prefill and 31 decodes each
    assert delta(split_steps(d.att), before) == {"4": MAX_TOKENS, "2": MAX_TOKENS}


def test_a_batch_below_the_threshold_runs_unsplit(one_to_one):
    d = one_to_one
    before = split_steps(d.att)
    set_m(d.att, 2, decode_threshold=8)
    run_batch(d.att.url)  # four decodes per step: below 8, unsplit
    # only the prefill (21 tokens, above its threshold of 4) was split
    assert delta(split_steps(d.att), before) == {"1": MAX_TOKENS - 1, "2": 1}


def test_auto_microbatches_measure_every_m_then_choose_per_step(one_to_one):
    """num_microbatches "auto" in a real server: the decode steps of a batch of four run
    m = 1 and then m = 2 for the tuner's warm-up (a step unmeasured, then the steps it
    compares; larger m only while they pay), then the m it measured fastest; every request
    completes. (Which m wins depends on timing, so the tokens are checked
    against a fixed reference at the step engine's level, tests/afd_core.)"""
    d = one_to_one
    set_m(d.att, 1, decode_threshold=2)
    before = split_steps(d.att)
    stats = set_m(d.att, "Auto")  # any case, as the config
    assert "tuner" in stats
    out = run_batch(d.att.url)
    assert [len(c.token_ids) for c in out] == [MAX_TOKENS] * 4
    ran = delta(split_steps(d.att), before)
    assert sum(ran.values()) == MAX_TOKENS and "2" in ran, ran
    tuner = rpc(d.att.url, "afd_step_stats")[0]["tuner"]
    decode = tuner["decode~4"]["by_microbatches"]
    warm = WARMUP_STEPS + WINDOW
    assert decode["1"][0] >= warm and decode["2"][0] >= warm, tuner
    set_m(d.att, 1)


def test_ffn_server_rejects_requests(one_to_one):
    with pytest.raises(ServerError, match="400.*AFD FFN server.*attention server"):
        complete(one_to_one.ffn.url, "hi", 4, timeout=30)


@pytest.mark.parametrize("side", ["ffn", "attention"])
def test_a_failed_step_fails_its_request_and_the_next_one_is_served(one_to_one, side):
    d = one_to_one
    set_m(d.att, 2, decode_threshold=2)
    if side == "ffn":
        rpc(d.ffn.url, "afd_inject_step_failure", "1", "test")
    else:
        rpc(d.att.url, "afd_inject_step_failure", "test")
    with pytest.raises(ServerError, match="500"):
        complete(d.att.url, PROMPTS[0], MAX_TOKENS)
    assert_same(_ALONE[d.arch], run_prompts(d.att.url))  # the deployment goes on
    log = d.att.log_path.read_text(errors="replace")
    if side == "ffn":
        assert "FFN rank 0" in log and "failed layer 1" in log, d.att.log_tail(60)
        assert "injected FFN step failure (test)" in log, d.att.log_tail(60)
    else:
        assert "failed on this rank (micro-batch" in log, d.att.log_tail(60)
        assert "injected attention step failure (test)" in log, d.att.log_tail(60)
    assert "finish with an error" in log, d.att.log_tail(60)
    assert d.att.proc.poll() is None and d.ffn.proc.poll() is None


def afd_metrics(url: str) -> dict:
    """{(name, labels...): value} of the afd_* samples on a server's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("afd_")
        for s in family.samples
    }


def test_both_roles_show_afd_metrics_on_vllms_metrics_endpoint(one_to_one):
    d = one_to_one
    att_rank = (("rank", "0"), ("role", "attention"))
    ffn_rank = (("rank", "0"), ("role", "ffn"))

    def scrape():
        time.sleep(1.2)  # a rank writes its numbers at most once a second, at a step's end
        complete(d.att.url, PROMPTS[0], 2)
        return afd_metrics(d.att.url), afd_metrics(d.ffn.url)

    att, ffn = scrape()
    run_prompts(d.att.url)
    att2, ffn2 = scrape()
    for before, after, rank in ((att, att2, att_rank), (ffn, ffn2, ffn_rank)):
        assert after[("afd_peer_up", ("peer", "0"), *rank)] == 1.0
        for name in ("afd_steps_total", "afd_exchange_wait_seconds_count",
                     "afd_rows_per_microbatch_count"):  # fmt: skip
            assert after[(name, *rank)] > before[(name, *rank)] > 0, name
    assert ffn2[("afd_ffn_busy_seconds_total", *ffn_rank)] > 0
    assert ffn2[("afd_ffn_idle_seconds_total", *ffn_rank)] > 0
    assert ffn2[("afd_peers_lost_total", *ffn_rank)] == 0
    print({k: v for k, v in ffn2.items() if "bucket" not in k[0]})


# one architecture: `afd bench` reads step traces and timings, whatever the model
@pytest.mark.parametrize("one_to_one", ["deepseek_v2"], indirect=True)
def test_afd_bench_measures_this_deployment(one_to_one, tmp_path):
    """`afd bench` against this running deployment, the smallest run (one sweep size pair,
    one repetition, batch 2): checks what it writes, not speed."""
    from afd_core.planner.hardware import load_hardware
    from afd_plugin.cli import main as afd_main

    d = one_to_one
    set_m(d.att, 1, decode_threshold=2)
    out = tmp_path / "bench"
    args = ["--sweep-hidden", "64", "--sweep-rows", "1", "4", "--sweep-iters", "5"]
    args += ["--batch-size", "2", "--num-iters", "1", "--output-len", "4", "--out", str(out)]
    args += ["--colocated-url", d.colocated.url, "--attention-url", d.att.url]
    args += ["--trace", d.trace, "--model", d.model, "--save-profile", str(out / "p.json")]
    exe = shutil.which("afd", path=str(Path(sys.executable).parent))
    run = subprocess.run([exe, "bench", *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    for stage in ("(1/4) connector sweep", "(2/4) compute", "(3/4) serving", "(4/4) calib"):
        assert stage in run.stderr, run.stderr
    result = json.loads((out / "bench.json").read_text())
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["format"] == 1
    sweep = result["connector_sweep"]
    assert [(r["hidden"], r["rows"], r["bytes"]) for r in sweep] == [(64, 1, 128), (64, 4, 512)]
    for r in sweep:
        for side in ("raw_us", "afd_us"):
            assert r[side]["n"] == 5 and 0 < r[side]["p10"] <= r[side]["median"] <= r[side]["p90"]
        assert r["ratio"] == pytest.approx(r["afd_us"]["median"] / r["raw_us"]["median"])
    assert result["link_fit"]["latency_us"] >= 0 and result["link_fit"]["bandwidth_gbps"] > 0
    assert result["compute"]["matmul_gflops"] > 0 and result["compute"]["memory_gbps"] > 0
    rows = {(r["batch"], r["config"]): r for r in result["serving"]["results"]}
    assert set(rows) == {(2, "colocated"), (2, "AFD m=1"), (2, "AFD m=2")}
    assert (
        rows[(2, "colocated")]["vs_colocated"] == 1.0 and rows[(2, "colocated")]["step_ms"] is None
    )
    assert rows[(2, "AFD m=1")]["vs_afd_m1"] == 1.0
    for name in ("AFD m=1", "AFD m=2"):
        assert rows[(2, name)]["tpot_ms"]["n"] == 1 and rows[(2, name)]["step_ms"]["median"] > 0
    points = result["calibration"]["points"]
    assert [(q["batch"], q["microbatches"]) for q in points] == [(2, 1), (2, 2)]
    assert all(q["predicted_step_ms"] > 0 and q["measured_step_ms"] > 0 for q in points)
    profile = load_hardware(str(out / "p.json"))
    assert profile.to_dict() == result["profile"]
    assert profile.attention_layer_overhead_us > 0 and profile.ffn_layer_overhead_us > 0
    # the profile is what `afd plan` reads: a 1 s TPOT target is met on this machine
    assert afd_main(["plan", "--model", d.model, "--hardware", str(out / "p.json"),
                     "--tpot-ms", "1000", "--context", "64", "--max-devices", "4"]) == 0  # fmt: skip


def ft_status(server) -> list[tuple]:
    """(id, status, fault_info) of each engine on vLLM's GET /fault_tolerance/status."""
    with urllib.request.urlopen(server.url + "/fault_tolerance/status", timeout=30) as r:
        body = json.loads(r.read())
    assert body["schema_version"] == 1 and body["total_engines"] == len(body["engines"])
    return [(e["id"], e["status"], e.get("fault_info")) for e in body["engines"]]


def ft_retry(server) -> dict:
    """vLLM's POST /fault_tolerance/apply with `retry`: accepted at once (202)."""
    request = urllib.request.Request(
        server.url + "/fault_tolerance/apply",
        data=json.dumps({"instruction": "retry", "params": {}}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 202
        return json.loads(r.read())


def test_dead_ffn_fails_the_request_at_once_and_the_attention_server_waits(one_to_one):
    """Last user of the deployment but one: it kills the FFN server mid-generation."""
    d = one_to_one
    set_m(d.att, 1)
    # vLLM's fault-tolerance status, answered by AFD without vLLM's flag
    assert ft_status(d.att) == [(0, "healthy", None)]
    outcome = {}

    def long_request():
        try:
            outcome["ok"] = complete(d.att.url, PROMPTS[0], 450, timeout=120)
        except Exception as exc:  # noqa: BLE001 - the assertion below inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)  # mid-generation
    killed_at = time.monotonic()
    os.killpg(d.ffn.proc.pid, signal.SIGKILL)
    thread.join(STEP_TIMEOUT_S + 60)
    assert not thread.is_alive(), "the request hung after the FFN server died"
    assert "error" in outcome, "the request succeeded although the FFN server was killed"
    assert isinstance(outcome["error"], ServerError) and "500" in str(outcome["error"])
    elapsed = time.monotonic() - killed_at
    print(f"request failed {elapsed:.2f} s after the FFN server was killed")
    # a dead peer closes its sockets: noticed at once, long before the step timeout
    assert elapsed < STEP_TIMEOUT_S / 2, elapsed
    # the attention server names the lost peer and stays up, not ready, waiting for an FFN
    # server (connectors/admission/ffn_return.py; the restart is in tests/e2e/test_chaos.py)
    deadline = time.monotonic() + 30
    while d.att.health_status() != 503:
        assert d.att.proc.poll() is None, d.att.log_tail(60)
        assert time.monotonic() < deadline, d.att.log_tail(60)
        time.sleep(0.5)
    log = d.att.log_path.read_text(errors="replace")
    assert "lost FFN rank 0" in log and "closed the connection" in log, d.att.log_tail(60)
    # a lost FFN rank is unhealthy, not dead: the engine is up and waits for one
    [(engine, state, why)] = ft_status(d.att)
    assert (engine, state) == (0, "unhealthy") and "no FFN rank 0" in why, why


# one architecture: the FFN server's restart and the retry route do not depend on it
@pytest.mark.parametrize("one_to_one", ["deepseek_v2"], indirect=True)
def test_fault_tolerance_retry_brings_the_attention_server_back(one_to_one, log_dir):
    """Last user of the deployment: an orchestrator written for vLLM's fault-tolerance
    routes restarts the lost FFN server and sends `retry` until the attention server, never
    restarted, is healthy again."""
    d = one_to_one
    if d.ffn.proc.poll() is None:  # run alone: lose the FFN server first
        os.killpg(d.ffn.proc.pid, signal.SIGKILL)
    d.ffn.proc.wait(30)
    deadline = time.monotonic() + 30
    while ft_status(d.att)[0][1] != "unhealthy":
        assert time.monotonic() < deadline, d.att.log_tail(60)
        time.sleep(0.5)
    assert ft_retry(d.att)["request_id"]  # nothing to connect to yet: stays unhealthy
    time.sleep(2.0)
    assert ft_status(d.att)[0][1] == "unhealthy"

    restarted = Server(d.ffn.spec, d.ffn.log_path.parent)
    restarted.log_path = log_dir / f"{d.ffn.spec.name}-restarted.log"
    d.servers.insert(d.servers.index(d.att), restarted)  # stopped after the attention server
    started = time.monotonic()
    restarted.start()
    retries, last_retry, ffn_up_s = 0, started, None
    while ft_status(d.att)[0][1] != "healthy":
        if ffn_up_s is None and restarted.is_healthy():
            ffn_up_s = time.monotonic() - started
        assert restarted.proc.poll() is None, restarted.log_tail(60)
        assert d.att.proc.poll() is None, d.att.log_tail(60)
        assert time.monotonic() - started < 300, (d.att.log_tail(40), restarted.log_tail(40))
        if time.monotonic() - last_retry >= 2.0:  # the orchestrator's retry, every 2 s
            ft_retry(d.att)
            retries, last_retry = retries + 1, time.monotonic()
        time.sleep(0.2)
    healthy_s = time.monotonic() - started
    while not d.att.is_healthy():  # /health agrees (its snapshot is the same)
        assert time.monotonic() - started < healthy_s + 10, d.att.log_tail(60)
        time.sleep(0.2)
    while ffn_up_s is None and not restarted.is_healthy():
        assert time.monotonic() - started < 300, restarted.log_tail(60)
        time.sleep(0.2)
    ffn_up_s = ffn_up_s or time.monotonic() - started
    back = [line for line in d.att.log_path.read_text(errors="replace").splitlines()
            if "serves this rank again" in line]  # fmt: skip
    assert back, d.att.log_tail(60)
    print(
        f"\nFFN server restarted: attention server healthy on /fault_tolerance/status after "
        f"{healthy_s:.1f} s ({retries} retries sent, every 2 s); the FFN server's /health "
        f"200 after {ffn_up_s:.1f} s\n{back[-1]}"
    )
    got = complete(d.att.url, PROMPTS[0], MAX_TOKENS)  # served, the colocated tokens
    assert got.token_ids == _ALONE[d.arch][0].token_ids
    # retry on a healthy engine is rejected, as vLLM rejects it (its reason on the status)
    ft_retry(d.att)
    deadline = time.monotonic() + 10
    while "ft_error" not in (entry := _ft_engine(d.att)):
        assert time.monotonic() < deadline, entry
        time.sleep(0.2)
    assert entry["status"] == "healthy" and "status is HEALTHY" in entry["ft_error"], entry


def _ft_engine(server) -> dict:
    with urllib.request.urlopen(server.url + "/fault_tolerance/status", timeout=30) as r:
        return json.loads(r.read())["engines"][0]


# DeepSeek-V2: 2A1F with async DP (the attention DP ranks step independently). Qwen3-MoE:
# 2A2F, the FFN server's two data-parallel ranks running the MoE layers as one expert group
# (vLLM's DP MoE: experts sharded over both FFN ranks), so its attention ranks in lockstep
FFN_RANKS = {"deepseek_v2": 1, "qwen3_moe": 2}
ASYNC_DP = {"deepseek_v2": True, "qwen3_moe": False}


def settled_stats(ffn, timeout_s: float = 10.0) -> dict:
    """The FFN rank's step stats once no step is in flight: after the last request, the
    attention data-parallel ranks may still run a dummy step of their wave, which the
    expert group counts when it starts and the server when it ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = rpc(ffn.url, "afd_step_stats")[0]
        if stats.get("group_steps") == stats["steps"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


@pytest.mark.parametrize("arch", list(BACKENDS))
def test_data_parallel_attention_with_microbatches(arch, checkpoints, log_dir):
    model = str(checkpoints(arch))
    f, async_dp = FFN_RANKS[arch], ASYNC_DP[arch]
    ffn, att = afd_pair(
        model, arch, log_dir, f"2a{f}f", dp=2, ffn_ranks=f, afd_extra={"async_dp": async_dp}
    )
    servers = [ffn, att]
    if arch not in _ALONE:  # run alone: start the colocated reference alongside
        servers.insert(0, colocated_server(model, arch, log_dir))
    with running(servers):
        if arch not in _ALONE:
            _ALONE[arch] = run_prompts(servers[0].url)
        set_m(att, 1)
        assert_same(_ALONE[arch], run_prompts(att.url))
        # each data-parallel rank splits its share of the batch (two requests each: the
        # load balancer alternates) into micro-batches of one request: every request
        # computes exactly what it computes alone
        # (over two FFN ranks m = 4 would split two requests per rank as m = 2 does)
        for m in (2, 4) if f == 1 else (2,):
            set_m(att, m)
            assert_same(_ALONE[arch], run_batch(att.url))
        if f > 1:
            # three requests: one attention rank splits its two, the other runs its one
            # unsplit, so one FFN rank computes the second micro-batch with no rows of its own
            set_m(att, 2)
            assert_same(_ALONE[arch][:3], run_batch(att.url, PROMPTS[:3]), PROMPTS[:3])
            stats = settled_stats(ffn)  # FFN rank 0 (vLLM answers for one)
            assert stats["group_steps"] == stats["steps"] > 0 and stats["failed"] == 0, stats
            # FFN rank 0 counts it for the group, whichever member had no rows
            assert stats["group_zero_row_microbatches"] > 0, stats
        # requests on DP rank 0 only: in lockstep rank 1 runs a dummy forward (an AFD step)
        # whenever rank 0 steps; with async DP it runs none
        set_m(att, 1)
        steps = steps_on_one_rank(att.url, 0, PROMPTS[:2])
        assert steps.get(0, 0) >= MAX_TOKENS, steps
        if async_dp:
            assert steps.get(1, 0) == 0, steps
        else:
            assert steps.get(1, 0) >= MAX_TOKENS, steps
        if f > 1:
            _restart_the_expert_group_under_traffic(ffn, att, servers, log_dir, _ALONE[arch])


def _restart_the_expert_group_under_traffic(ffn, att, servers, log_dir, alone) -> None:
    """The FFN server (its two ranks one expert group) is killed and restarted while a
    client keeps sending requests to the attention server (its two DP ranks in lockstep):
    every request ends within its bound, with the colocated tokens or an error, and once
    the attention server is healthy again its ranks are served by the re-formed group
    (they switch to their new links at the same step: step/served_together.py) without
    the group breaking again."""
    set_m(att, 1)
    stop, history = threading.Event(), []

    def client():
        i = 0
        while not stop.is_set() and len(history) < 2000:  # bounded (and by the waits below)
            began = time.monotonic()
            try:
                got = complete(att.url, PROMPTS[i % 2], MAX_TOKENS, timeout=STEP_TIMEOUT_S + 30)
                history.append((began, time.monotonic(), i % 2, got.token_ids))
            except Exception as exc:  # noqa: BLE001 - the history is checked below
                history.append((began, time.monotonic(), i % 2, exc))
                # failed at once, the FFN server down: slowly, or the attention workers'
                # failing steps (vLLM's DP waves) keep both cores of a small machine from
                # the restarting FFN server
                time.sleep(3.0)
            i += 1

    thread = threading.Thread(target=client)
    thread.start()
    try:
        time.sleep(2.0)  # served
        os.killpg(ffn.proc.pid, signal.SIGKILL)
        ffn.proc.wait(30)
        killed = time.monotonic()
        restarted = Server(ffn.spec, ffn.log_path.parent)
        restarted.log_path = log_dir / f"{ffn.spec.name}-restarted.log"
        servers.insert(servers.index(att), restarted)  # stopped before the attention server
        restarted.start()
        while not att.is_healthy():
            assert restarted.proc.poll() is None, restarted.log_tail(60)
            assert att.proc.poll() is None, att.log_tail(60)
            assert time.monotonic() - killed < 300, (att.log_tail(40), restarted.log_tail(40))
            time.sleep(0.5)
        healthy = time.monotonic()
        # traffic on the re-formed group: at least six requests served after /health said so
        while sum(1 for b, _, _, r in history if b > healthy and isinstance(r, list)) < 6:
            assert restarted.proc.poll() is None, restarted.log_tail(60)
            assert time.monotonic() - healthy < 120, (att.log_tail(40), restarted.log_tail(40))
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join(STEP_TIMEOUT_S + 60)
    assert not thread.is_alive(), "a request hung"
    for began, ended, prompt, result in history:
        assert ended - began < STEP_TIMEOUT_S + 30, (began, ended, result)
        if isinstance(result, list):  # served: the colocated tokens, before and after
            assert result == alone[prompt].token_ids, (prompt, result)
        else:
            assert isinstance(result, ServerError) and "500" in str(result), result
    after = [r for b, _, _, r in history if b > healthy]
    assert all(isinstance(r, list) for r in after), after  # the group did not break again
    failed = sum(1 for *_, r in history if not isinstance(r, list))
    log = att.log_path.read_text(errors="replace")
    assert log.count(") serves this rank again after") == 2, att.log_tail(60)  # both ranks
    held = log.count("served on a new link, but holds its steps")
    print(
        f"\nexpert group restarted under traffic: attention server healthy "
        f"{healthy - killed:.1f} s after the kill; {len(history)} requests, {failed} failed "
        f"(all while the FFN server was down), {len(after)} served after; a rank held its "
        f"steps for its sibling {held} time(s)"
    )
    ffn_log = restarted.log_path.read_text(errors="replace")
    assert "lost a member" not in ffn_log and "lost FFN rank" not in ffn_log, ffn_log[-3000:]
