"""The NCCL connector's logic on CPU: NCCL and the CUDA runtime swapped for stand-ins
(tests/afd_core/nccl_standin.py) that keep NCCL's semantics — operations matched in issue
order per peer, each stream running its operations one after another — in real processes.

What a GPU is needed for (NCCL itself, CUDA streams and graphs) is in tests/gpu/check.py.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import traceback

import pytest

from afd_core.config import parse_afd_config
from afd_core.connectors.registry import default_connector_for
from afd_core.errors import AFDConfigError
from tests.afd_core import test_step_protocol as step_protocol
from tests.afd_core.gloo_harness import (
    HIDDEN,
    LAYERS,
    assert_no_errors,
    free_port,
    make,
    run_processes,
)

pytestmark = pytest.mark.vllm  # needs torch (the CPU build comes with vLLM)


@pytest.fixture
def over_nccl(monkeypatch):
    """Spawned test processes build the NCCL connector over the stand-ins."""
    monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")


# -- the protocol, unchanged, over an issue-ordered channel ------------------------------


@pytest.mark.parametrize(
    "a,f,steps",
    [
        (2, 1, {0: [(3, 4), (2,), (1, 1, 1, 1)], 1: [(1, 1, 1, 1), (0, 5, 0), (6,)]}),
        (
            4,
            2,
            {0: [(2, 2), (1,)], 1: [(3,), (0, 2, 2, 2)], 2: [(1, 1, 1), (5,)], 3: [(0,), (1, 1)]},
        ),
    ],
    ids=["2A1F", "4A2F"],
)
def test_micro_batches_and_shapes_over_nccl(over_nccl, a, f, steps):
    """Peers with different m, zero-row micro-batches, two groups: the step engine's tests
    pass as they are over a channel that matches by order, not by tag."""
    step_protocol.test_microbatches_every_m_and_shape(a, f, steps)


def test_no_stream_deadlock_with_overlapping_micro_batches(over_nccl):
    """Receives and sends on one stream would deadlock as soon as micro-batches overlap;
    here each direction has its own, and 12 layers x m = 4 finish within a 3 s bound."""
    step_protocol.test_deadlock_canary_short_timeout_many_layers()


def test_failed_steps_stay_in_step_over_nccl(over_nccl):
    """The zeros of an aborted step go out on the device, and the FFN rank's verdict comes
    over the control channel: both sides go on with the next step."""
    step_protocol.test_failed_steps_on_either_side_fail_only_that_step()


def test_a_wrong_step_number_costs_its_sender_only_over_nccl(over_nccl):
    """A wrong step number (issue 36, review M3): the FFN rank drops its sender, whose own
    link is aborted (each attention rank has one), and serves the other attention rank on;
    the dropped rank's steps fail from then on and it waits for an FFN rank, as on gloo.
    (The FFN rank then waits for the dropped rank's restart: only the attention ranks
    report.)"""
    steps = {0: [(2,), (2,), (2,)], 1: [(1, 1), (1, 1), (1, 1)]}
    results = step_protocol.deploy(2, 1, steps, skip={1: 1}, timeout=5.0, expect=2)
    assert_no_errors(results)
    assert results[("attention", 0)] == ["ok"] * 3
    out = results[("attention", 1)]
    assert out[0] == "ok" and len(out) == 3, out
    for failed in out[1:]:
        assert failed.startswith("step failed") and "is gone" in failed, out


def test_pairs_connect_at_start_up_so_the_first_step_cannot_deadlock(monkeypatch):
    """NCCL connects a pair at its first operation, blocking the host until the peer's
    first operation on the same communicator (the stand-in does too). Without the
    start-up connection the first step deadlocks (the attention rank's first operation is
    its receive on `from_first`, the FFN rank's its receive on `to_first`): the stand-in
    turns that into an error naming it; with it, 2 peers x m = 2 run."""
    monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")
    monkeypatch.setenv("AFD_TEST_NCCL_HANDSHAKE_S", "3")
    steps = {0: [(2, 3), (1,)], 1: [(4,), (0, 2)]}
    results = step_protocol.deploy(2, 1, steps, timeout=10.0)
    assert_no_errors(results)
    assert results[("attention", 0)] == ["ok", "ok"]
    assert results[("attention", 1)] == ["ok", "ok"]
    monkeypatch.setenv("AFD_TEST_NO_PRECONNECT", "1")
    results = step_protocol.deploy(2, 1, {0: [(2,)], 1: [(1,)]}, timeout=10.0)
    for key in (("ffn", 0), ("attention", 0)):
        text = str(results[key])
        assert "found no first operation of the peer" in text, text


@pytest.mark.parametrize("mutation", [False, True], ids=["posted-after-send", "MUTATION-prefetch"])
def test_a_device_wide_wait_inside_the_ffns_step_cannot_deadlock(monkeypatch, mutation):
    """The FFN's compute waits for the whole device first (the stand-in's synchronize, as
    a lazily loaded kernel, a cudaMalloc or a synchronize in vLLM would on the first
    step). With the next receive posted after the send, nothing on the device waits for
    work this host has not enqueued: m = 1 and m = 2 run. Mutation check: the old order
    (the next receive posted before the compute, AFD_TEST_FFN_EAGER_PREFETCH) holds a
    receive of the next layer of the same rows, which the peer sends only after this
    layer's output: the synchronize can never return (the stand-in names it)."""
    monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")
    monkeypatch.setenv("AFD_TEST_FFN_DEVICE_SYNC", "1")
    monkeypatch.setenv("AFD_TEST_DEVICE_SYNC_S", "3")
    if mutation:
        monkeypatch.setenv("AFD_TEST_FFN_EAGER_PREFETCH", "1")
    steps = {0: [(3,), (2, 2), (4,)]}
    results = step_protocol.deploy(1, 1, steps, timeout=8.0)
    if not mutation:
        assert_no_errors(results)
        assert results[("attention", 0)] == ["ok", "ok", "ok"]
        return
    # the m = 1 steps fail, naming the wait that would hang a GPU; with m = 2 the
    # prefetched receive is the other micro-batch's, which the peer sends regardless
    outcome = results[("attention", 0)]
    assert [o.split(":")[0] for o in outcome] == ["step failed", "ok", "step failed"], outcome
    assert "a device-wide synchronize waited 3s" in outcome[0], outcome


def _checked_steps(driver, steps, outcome: list) -> None:
    """Run one-micro-batch steps [(rows, job, flags)] on attention rank 0, appending to
    `outcome` "ok" (the output is the protocol test's reference), "wrong output in step s"
    or "step failed: why"."""
    import torch

    from afd_core.connectors.base import AFDStepError

    for step, (n, job, flags) in enumerate(steps):
        try:
            [out] = driver.run((n,), [job], flags=flags)
        except AFDStepError as exc:
            outcome.append(f"step failed: {exc}")
            continue
        want = step_protocol.expected(0, step, 0, n, LAYERS)
        outcome.append("ok" if torch.equal(out, want) else f"wrong output in step {step}")


def capturing_attn(port, fail_layer, q):
    """Steps: eager (2 rows), a capture of 4 rows that fails at `fail_layer`, then eager
    steps of 3 and 5 rows whose outputs are checked."""

    from afd_core.connectors.protocol.control import ControlFlag
    from afd_core.step.attention import AttentionStepDriver

    outcome = []
    try:
        conn = make("attention", 0, 1, 1, port, timeout=8.0)
        conn.init()
        driver = AttentionStepDriver(conn)
        rt = conn.runtime

        def job(step, n, capture=False):
            def run():
                graph = contextlib.nullcontext() if not capture else rt.capture([])
                with graph:
                    h = step_protocol.initial(0, step, 0, n)
                    for layer in range(LAYERS):
                        h = h + 1
                        if capture and layer == fail_layer:
                            raise RuntimeError(f"injected capture failure at layer {layer}")
                        h = conn.start_exchange(h, layer, 0).wait()
                    return h

            return run

        steps = [(2, False), (4, True), (3, False), (5, False)]
        _checked_steps(
            driver,
            [
                (n, job(s, n, capture), ControlFlag.CAPTURE if capture else ControlFlag.NONE)
                for s, (n, capture) in enumerate(steps)
            ],
            outcome,
        )
        driver.close()
        conn.close()
        q.put((("attention", 0), outcome))
    except Exception:
        q.put((("attention", 0), "ERROR " + traceback.format_exc()))


@pytest.mark.parametrize("fail_layer", [0, LAYERS - 1], ids=["layer-0", "last-layer"])
def test_a_failed_capture_leaves_both_sides_in_step(monkeypatch, fail_layer):
    """A graph capture that fails on the attention side (an illegal op, an OOM) moved
    nothing on either side: the FFN rank recorded its whole step and sent its status.
    The attention side takes that status only, the step fails with its cause, and the
    next steps are exchanged correctly. (Exchanging zeros for the rest of the step, as an
    eager step's clean-up does, would leave receives nobody answers: the FFN is already
    waiting for the next control message.)"""
    monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")
    monkeypatch.setenv("AFD_TEST_FFN_GRAPHS", "1")
    port = free_port()
    results = run_processes(
        [
            (step_protocol.ffn_main, 0, 1, 1, port, LAYERS, 8.0, []),
            (capturing_attn, port, fail_layer),
        ]
    )
    assert_no_errors(results)
    outcome = results[("attention", 0)]
    assert outcome[0] == "ok" and outcome[2:] == ["ok", "ok"], outcome
    assert outcome[1].startswith("step failed"), outcome
    assert f"injected capture failure at layer {fail_layer}" in outcome[1], outcome
    assert "both sides recorded it and nothing moved" in outcome[1], outcome
    ffn = results[("ffn", 0)]
    assert ffn["graphs"] == {"captured": 1, "replayed": 0, "eager": 3}, ffn
    assert ffn["failed"] == 0, ffn


STARTUP_DELAY_S = 4.0  # the first forward's "compile", past the 2 s step timeout


def slow_first_forward_attn(port, startup: bool, q):
    """Two steps; the first one's forward starts STARTUP_DELAY_S after its control message
    (as a cold first forward compiles after announcing the step), flagged STARTUP or not."""

    from afd_core.connectors.base import AFDPeerError
    from afd_core.connectors.protocol.control import ControlFlag
    from afd_core.step.attention import AttentionStepDriver

    outcome = []
    try:
        conn = make("attention", 0, 1, 1, port, timeout=2.0)
        conn.init()
        driver = AttentionStepDriver(conn)

        def job(step, n, delay):
            def run():
                time.sleep(delay)
                h = step_protocol.initial(0, step, 0, n)
                for layer in range(LAYERS):
                    h = conn.start_exchange(h + 1, layer, 0).wait()
                return h

            return run

        first = ControlFlag.PROFILE | (ControlFlag.STARTUP if startup else ControlFlag.NONE)
        _checked_steps(
            driver, [(4, job(0, 4, STARTUP_DELAY_S), first), (2, job(1, 2, 0.0), 0)], outcome
        )
        driver.close()
        conn.close()
        q.put((("attention", 0), outcome))
    except AFDPeerError as exc:
        q.put((("attention", 0), outcome + [f"STOPPED AFDPeerError: {exc}"]))
    except Exception:
        q.put((("attention", 0), "ERROR " + traceback.format_exc()))


@pytest.mark.parametrize("connector", ["gloo", "nccl"])
def test_a_start_up_step_whose_forward_starts_late_is_served(monkeypatch, connector):
    """A cold first forward compiles after its control message went out (torch.compile,
    Triton and kernel JIT take minutes on a large model). Steps flagged STARTUP (the
    attention server's profiling run, warm-up and captures) are bounded by
    startup_timeout_s on both sides: a forward 4 s late under a 2 s step timeout is served.
    The same step unflagged trips the step timeout (the bound that applies once serving)."""
    if connector == "nccl":
        monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")
    monkeypatch.setenv("AFD_TEST_STARTUP_TIMEOUT_S", "20")
    results = {}
    for startup in (True, False):
        port = free_port()
        results[startup] = run_processes(
            [
                (step_protocol.ffn_main, 0, 1, 1, port, LAYERS, 2.0, []),
                (slow_first_forward_attn, port, startup),
            ],
            expect=2 if startup else 1,  # unflagged: whichever side reports first
        )
    assert results[True][("attention", 0)] == ["ok", "ok"], results[True]
    # unflagged, the FFN gave up on the step after 2 s: the attention step failed with it
    # (gloo drops the peer) or the FFN rank stopped naming the bound (NCCL's watchdog)
    first = results[False]
    if ("attention", 0) in first:
        assert first[("attention", 0)][0] != "ok", first
    else:
        assert "no answer within 2s" in str(first[("ffn", 0)]), first


def late_ffn(port, a, q):
    try:
        conn = make("ffn", 0, a, 1, port, connect_timeout=LATE_CONNECT_S)
        conn.init()
        plan = conn.recv_control()
        for layer in range(LAYERS):
            for mb in range(plan.num_microbatches):
                batch = conn.recv_attn_output(layer, mb)
                conn.send_ffn_output(batch.hidden_states * 2, layer, mb)
        conn.finish_step()
        for _ in range(a):
            conn.recv_control()  # the goodbyes
        conn.close()
        q.put(("ffn", "ok"))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def late_attn(port, a, rank, q):
    import os

    import torch

    # gloo's pair: the side with the lower address waits for the other's connect; here
    # always the FFN rank (127.0.0.1), as it would be half the time by port order
    os.environ["AFD_CHANNEL_ADDRESS"] = "127.0.0.2"
    try:
        conn = make("attention", rank, a, 1, port, connect_timeout=LATE_CONNECT_S)
        conn.init()
        time.sleep(LATE_CONNECT_S * 2)  # longer than the connect timeout
        conn.begin_step((2,))
        for layer in range(LAYERS):
            h = torch.full((2, HIDDEN), float(rank + 1))
            assert torch.equal(conn.start_exchange(h, layer).wait(), h * 2)
        conn.end_step()
        conn.close()
        q.put((rank, "ok"))
    except Exception:
        q.put((rank, "ERROR " + traceback.format_exc()))


LATE_CONNECT_S = 2.0


@pytest.mark.parametrize("connector", ["nccl", "gloo"])
def test_a_peer_whose_first_step_comes_after_the_connect_timeout_is_served(monkeypatch, connector):
    """Each control pair connects at start-up (one word each way, within the connect
    timeout). Left to the first step, the FFN rank's control listener posted its receive at
    once and its pair waited for the peer's connect, which came with the peer's first step:
    4 s after a 2 s connect timeout, the FFN rank failed ("control receive: no answer
    within 2592000s") and took the deployment down."""
    if connector == "nccl":
        monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")
    # the rendezvous waits for the processes to start (seconds apart on a loaded machine:
    # CI once missed a 2 s bound there); only the pairs' connect has the short bound
    monkeypatch.setenv("AFD_TEST_STARTUP_TIMEOUT_S", "30")
    port = free_port()
    out = run_processes([(late_ffn, port, 2)] + [(late_attn, port, 2, r) for r in range(2)])
    assert out == {"ffn": "ok", 0: "ok", 1: "ok"}, out


# -- what the NCCL transport does with communicators, streams and buffers ----------------


def _comm_counts(t) -> dict:
    """Per direction, over every link's communicators (the AFD group's transport has one
    pair of communicators per attention member)."""
    pairs = [link.comms for link in t._links.values()] or [t._comms]
    directions = ("to_first", "from_first")
    return {
        "comms": {
            d: (sum(len(c[d].sent) for c in pairs), sum(len(c[d].received) for c in pairs))
            for d in directions
        },
        "launches": {d: sum(c[d].launches for c in pairs) for d in directions},
        "links": len(t._links),
    }


def _count_watched(t) -> list:
    """What the transport hands its watchdog, in order (counted as handed over: the watchdog
    drops completed ones at once)."""
    watched = []
    real_watch = t._watchdog.watch
    t._watchdog.watch = lambda *args, **kw: (watched.append(args[1]), real_watch(*args, **kw))
    return watched


def usage_ffn(port, a, q):
    try:
        conn = make("ffn", 0, a, 1, port, router_width=4, token_ids=True)
        conn.init()
        ring = [tuple(b.data_ptr() for b in slot) for slot in conn._ring]
        capacity = conn._ring[0][0].shape[0]
        addresses = []
        for _ in range(3):
            plan = conn.recv_control()
            for layer in range(3):
                for mb in range(plan.num_microbatches):
                    batch = conn.recv_attn_output(layer, mb)
                    addresses.append(
                        (batch.hidden_states.data_ptr(), batch.router_logits.data_ptr())
                    )
                    conn.send_ffn_output(batch.hidden_states * 2, layer, mb)
            conn.finish_step()
        for _ in range(a):
            conn.recv_control()  # the goodbyes
        t = conn._transport
        counts = _comm_counts(t)
        streams = len(t.runtime.streams)
        conn.close()
        result = {"ring": ring, "capacity": capacity, "addresses": addresses, "streams": streams}
        q.put(("ffn", {**result, **counts}))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def usage_attn(port, a, rank, q):
    import torch

    try:
        conn = make("attention", rank, a, 1, port, router_width=4, token_ids=True)
        conn.init()
        watched = _count_watched(conn._transport)
        for rows in [(5,), (2, 3), (64,)]:
            conn.begin_step(rows)
            for layer in range(3):
                for mb, n in enumerate(rows):
                    h = torch.full((n, HIDDEN), float(layer + 1))
                    logits = torch.zeros(n, 4)
                    ids = torch.arange(n)
                    out = conn.start_exchange(h, layer, mb, logits, token_ids=ids).wait()
                    assert torch.equal(out, h * 2)
            conn.end_step()
        t = conn._transport
        counts = _comm_counts(t)
        waits = t.runtime.waits
        conn.close()
        q.put((f"attention{rank}", {**counts, "waits": waits, "watched": len(watched)}))
    except Exception:
        q.put(("attention", "ERROR " + traceback.format_exc()))


@pytest.mark.parametrize("a", [1, 2], ids=["1A1F", "2A1F"])
def test_one_launch_per_direction_and_layer_and_fixed_receive_buffers(over_nccl, a):
    port = free_port()
    out = run_processes([(usage_ffn, port, a)] + [(usage_attn, port, a, r) for r in range(a)])
    assert_no_errors(out)
    ffn = out["ffn"]
    exchanges = 3 * (1 + 2 + 1)  # layers x micro-batches over the three steps
    for r in range(a):
        attn = out[f"attention{r}"]
        # attention -> FFN: rows, logits and token ids (3 per exchange) on `to_first` only;
        # FFN -> attention: the outputs on `from_first` only; plus the one-byte operation
        # each way that connected the pair at start-up
        assert attn["comms"] == {
            "to_first": (3 * exchanges + 1, 0),
            "from_first": (0, exchanges + 1),
        }
        # one launch (one NCCL group, one event, one watchdog entry) per direction and
        # exchange: the three sends go out together
        assert attn["launches"] == {"to_first": exchanges + 1, "from_first": exchanges + 1}
        assert attn["links"] == 1
        assert attn["watched"] == 2 * exchanges  # (the start-up connection polls its own)
        # the caller's stream joins each launch once: 2 waits per exchange, not 4
        assert attn["waits"] == 2 * exchanges
    assert ffn["comms"] == {
        "to_first": (0, a * (3 * exchanges + 1)),
        "from_first": (a * (exchanges + 1), 0),
    }
    # each peer has a link (two communicators) of its own, so that it fails alone: the FFN
    # rank receives each peer's rows, logits and token ids of a layer/micro-batch in one
    # launch on that peer's link, and returns each peer's slice in one (start-up: one each)
    assert ffn["links"] == a
    assert ffn["launches"] == {"to_first": a * (exchanges + 1), "from_first": a * (exchanges + 1)}
    assert ffn["streams"] == 2
    # receive buffers: allocated once at start-up for the peers' max-num-batched-tokens
    # (64 each, so the 64-row step fits), two sets used in turn, the same addresses every step
    assert ffn["capacity"] == 64 * a
    hidden_slots = {slot[0] for slot in ffn["ring"]}
    logits_slots = {slot[1] for slot in ffn["ring"]}
    assert {h for h, _ in ffn["addresses"]} == hidden_slots
    assert {g for _, g in ffn["addresses"]} == logits_slots
    first_step = ffn["addresses"][:3]
    assert ffn["addresses"][3] == first_step[0]  # step 2 starts on the same buffers


def silent_ffn(port, q):
    """Takes the step's control message, receives the rows, then never answers."""
    try:
        conn = make("ffn", 0, 1, 1, port, timeout=2.0)
        conn.init()
        conn.recv_control()
        conn.recv_attn_output(0)
        time.sleep(4)  # the peer's watchdog fires after 2 s
        q.put(("ffn", "ok"))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def waiting_attn(port, q):
    import torch

    try:
        conn = make("attention", 0, 1, 1, port, timeout=2.0)
        conn.init()
        conn.begin_step((3,))
        t = conn._transport
        comms = [c for link in t._links.values() for c in link.comms.values()]
        t0 = time.monotonic()
        try:
            conn.start_exchange(torch.ones(3, HIDDEN), 0).wait()
            q.put(("attention", "no error"))
        except Exception as exc:
            aborted = [c.aborted for c in comms] or ["cleared"]
            q.put(("attention", (f"{type(exc).__name__}: {exc}", time.monotonic() - t0, aborted)))
    except Exception:
        q.put(("attention", "ERROR " + traceback.format_exc()))


def test_watchdog_turns_a_stuck_receive_into_the_named_error(over_nccl):
    """The FFN rank takes the rows and never answers: the attention rank's watchdog aborts
    its link after its bound (twice the step timeout: ATTENTION_WAIT_FACTOR), and the step
    fails naming the layer, the step and the bound; the rank stays up and waits for an FFN
    rank (as on gloo)."""
    out = run_processes([(silent_ffn, port := free_port()), (waiting_attn, port)])
    assert out["ffn"] == "ok", out
    text, waited, aborted = out["attention"]
    assert text.startswith("AFDFFNLostError"), text
    assert "layer 0 (micro-batch 0) of step 0" in text and "FFN rank 0" in text, text
    assert "no answer within 4s; the NCCL link with group rank 0 was aborted" in text, text
    assert aborted == [True, True], aborted  # both communicators of the link
    assert 3.5 < waited < 8, waited


# -- units --------------------------------------------------------------------------------


def test_watchdog_fires_once_for_the_first_late_operation():
    from afd_core.connectors.transports.device import Watchdog

    class Ev:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    fired = []
    dog = Watchdog("t", lambda what, t: fired.append((what, t)))
    dog.watch(Ev(True), "done at once", 0.05)
    late = Ev(False)
    dog.watch(late, "receive from group rank 1", 0.2)
    dog.watch(Ev(False), "a later one", 0.3)
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.4)
    assert fired == [("receive from group rank 1", 0.2)]


class RecordingComm:
    """A communicator that records its calls; `group=False`: one without group calls (HCCL
    through torch.distributed), `fail_at`: the operation that raises."""

    def __init__(self, group: bool = True, fail_at: int | None = None):
        self.calls: list = []
        self._fail_at = fail_at
        if group:
            self.group_start = lambda: self.calls.append("group_start")
            self.group_end = lambda: self.calls.append("group_end")

    def send(self, tensor, peer, stream):
        self._op("send", peer, stream)

    def recv(self, tensor, peer, stream):
        self._op("recv", peer, stream)

    def _op(self, kind, peer, stream):
        if len([c for c in self.calls if isinstance(c, tuple)]) == self._fail_at:
            raise RuntimeError("unhandled cuda error")
        self.calls.append((kind, peer))

    def abort(self):
        pass


def _bare_transport(send_comm, recv_comm):
    """An NCCL transport wired to the given communicators over the host runtime, with its
    watchdog's entries recorded."""
    from afd_core.connectors.transports.device import Watchdog
    from afd_core.connectors.transports.nccl import NcclTransport
    from tests.afd_core.nccl_standin import HostRuntime

    runtime = HostRuntime()
    t = NcclTransport("127.0.0.1", 1, 0, 0, 3, False, 5.0, 5.0, runtime=runtime, comm_factory=None)
    t._send_comm, t._recv_comm = send_comm, recv_comm
    t._comms = {"from_first": send_comm, "to_first": recv_comm}
    t._send_stream, t._recv_stream = runtime.new_stream(), runtime.new_stream()
    t._watchdog = Watchdog("t", lambda *a: None)
    return t, _count_watched(t)


def test_captured_operations_are_not_watched_and_keep_their_buffers():
    """Inside a graph capture no Python runs at replay: nothing is put under the watchdog
    (the step's status bounds a replay) and no allocator hint is given."""
    import torch

    comm = RecordingComm(group=False)
    t, watched = _bare_transport(comm, comm)
    runtime = t.runtime
    hints = []
    runtime.record_stream = lambda tensor, stream: hints.append(stream)
    runtime.capturing = True
    t.isend(torch.ones(2), 0, 0)
    t.irecv(torch.ones(2), 0, 0)
    assert watched == [] and hints == []
    runtime.capturing = False
    t.isend(torch.ones(2), 0, 0)
    assert watched == ["send to group rank 0"] and len(hints) == 1
    assert comm.calls == [("send", 0), ("recv", 0), ("send", 0)]
    t._watchdog.stop()


def test_aborted_channel_fails_every_later_operation_by_name():
    import torch

    from afd_core.connectors.transports.device import ChannelAborted
    from afd_core.connectors.transports.nccl import NcclTransport
    from tests.afd_core.nccl_standin import HostRuntime

    aborted = []

    class Comm:
        def abort(self):
            aborted.append(1)

    t = NcclTransport(
        "127.0.0.1", 1, 0, 1, 2, False, 5.0, 5.0, runtime=HostRuntime(), comm_factory=None
    )
    t._comms = {"to_first": Comm(), "from_first": Comm()}
    t._send_comm = t._recv_comm = Comm()
    t._expired("receive from group rank 0", 5.0)
    assert len(aborted) == 2
    with pytest.raises(ChannelAborted, match="receive from group rank 0: no answer within 5s"):
        t.isend(torch.ones(1), 0, 0)


def test_connector_rejects_tensors_on_another_device():
    from afd_core.connectors.base import WireSpec
    from afd_core.connectors.nccl import NcclConnector
    from tests.afd_core.nccl_standin import HostRuntime

    cfg = parse_afd_config({"role": "attention", "connector": "nccl"}, device_type="cuda")
    conn = NcclConnector(cfg, 0, WireSpec(8, "float32", 2, 16), runtime=HostRuntime())
    import torch

    conn.check_tensor(torch.ones(1))
    with pytest.raises(ValueError, match="connector 'nccl' moves tensors on cpu, got a tensor"):
        conn.check_tensor(torch.ones(1, device="meta"))


def test_nccl_is_the_cuda_default_and_each_connector_stays_on_its_platform():
    assert default_connector_for("cuda") == "nccl"
    assert parse_afd_config({"role": "ffn"}, device_type="cuda").connector == "nccl"
    with pytest.raises(AFDConfigError) as err:
        parse_afd_config({"role": "ffn", "connector": "nccl"}, device_type="cpu")
    assert err.value.field == "connector"
    assert "connector='nccl' runs on cuda, but this platform is 'cpu'; allowed here: 'gloo'" in (
        str(err.value)
    )
    with pytest.raises(AFDConfigError, match="connector='gloo' runs on cpu, but this platform"):
        parse_afd_config({"role": "ffn", "connector": "gloo"}, device_type="cuda")


def test_building_the_connector_touches_no_device():
    """A config check (or a CPU-only machine) builds the connector without CUDA: the
    device runtime and NCCL are reached only when it connects."""
    from afd_core.connectors.base import WireSpec
    from afd_core.connectors.factory import build_connector

    cfg = parse_afd_config({"role": "attention", "connector": "nccl"}, device_type="cuda")
    conn = build_connector(cfg, 0, WireSpec(8, "bfloat16", 2, 16))
    assert type(conn).__name__ == "NcclConnector" and conn._runtime is None
    assert threading.active_count() >= 1


def test_a_keyed_operation_past_its_deadline_costs_its_key_alone():
    """Operations of a per-member link are watched under the link's key: the first one
    past its deadline calls on_key_expired with the key, that key's other operations leave
    the watch, and every other operation stays watched (and may complete). An operation
    without a key past its deadline stops the watchdog as before."""
    from afd_core.connectors.transports.device import Watchdog

    class Event:
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

    keyed, channel = [], []
    dog = Watchdog(
        "t", lambda what, t: channel.append(what), on_key_expired=lambda k, w, t: keyed.append(k)
    )
    stuck, stuck_later, healthy = Event(), Event(), Event()
    dog.watch(stuck, "receive from group rank 2", 0.2, key=2)
    dog.watch(stuck_later, "send to group rank 2", 0.3, key=2)
    dog.watch(healthy, "receive from group rank 1", 0.6, key=1)
    deadline = time.monotonic() + 5
    while not keyed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert keyed == [2] and dog.pending() == 1  # rank 2's two left, rank 1's is watched
    healthy.done = True
    while dog.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.pending() == 0 and keyed == [2] and channel == []
    dog.watch(Event(), "a group-wide launch", 0.1)
    while not channel and time.monotonic() < deadline:
        time.sleep(0.01)
    assert channel == ["a group-wide launch"]
    dog.stop()


def test_a_links_expiry_or_drop_aborts_that_link_alone():
    """Per-member links: the watchdog's expiry of one link aborts its two communicators
    and fails its later operations by name; the other link is untouched; a dropped member's
    link is aborted at once (its pending kernels end)."""
    import torch

    from afd_core.connectors.transports.device import ChannelAborted
    from afd_core.connectors.transports.device_transport import DeviceLink
    from afd_core.connectors.transports.nccl import NcclTransport
    from tests.afd_core.nccl_standin import HostRuntime

    class Comm(RecordingComm):
        def __init__(self):
            super().__init__()
            self.aborted = False

        def abort(self):
            self.aborted = True

    t = NcclTransport(
        "127.0.0.1", 1, 0, 0, 3, False, 5.0, 5.0, runtime=HostRuntime(), comm_factory=None
    )
    t.per_member_links = True
    t._links = {
        m: DeviceLink(ctrl=None, comms={"to_first": Comm(), "from_first": Comm()}, remote=1)
        for m in (1, 2)
    }
    t._start_streams()
    t._link_expired(2, "receive from group rank 2", 5.0)
    assert all(c.aborted for c in t._links[2].comms.values())
    assert not any(c.aborted for c in t._links[1].comms.values())
    with pytest.raises(ChannelAborted, match="the NCCL link with group rank 2 was aborted"):
        t.isend(torch.ones(1), 2, 0)
    t.isend(torch.ones(1), 1, 0)  # the other link goes on
    assert t._links[1].comms["from_first"].calls == [("send", 1)]  # its pair's rank 1
    t.drop_member(1)
    assert all(c.aborted for c in t._links[1].comms.values())
    with pytest.raises(ChannelAborted, match="group rank 1 was dropped"):
        t.irecv(torch.ones(1), 1, 0)
    t._watchdog.stop()


def test_watchdog_thread_is_set_up_first_and_survives_a_failing_query():
    """The CUDA runtime sets the thread's capture mode first (a query from another thread
    during vLLM's global-mode capture would invalidate it); a query that raises counts as
    not done yet, and the thread goes on watching."""
    from afd_core.connectors.transports.device import Watchdog

    class Raising:
        def __init__(self):
            self.calls = 0

        def query(self):
            self.calls += 1
            if self.calls < 3:
                raise RuntimeError("operation not permitted when stream is capturing")
            return True

    setup, fired = [], []
    dog = Watchdog("t", lambda what, t: fired.append(what), thread_init=lambda: setup.append(1))
    ev = Raising()
    dog.watch(ev, "receive", 5.0)
    deadline = time.monotonic() + 5
    while dog.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert setup == [1] and ev.calls >= 3 and dog.pending() == 0 and fired == []
    dog.stop()


def test_a_grouped_block_is_one_launch_per_communicator_with_one_event_and_watch():
    """Item 9 of the CUDA review: every (layer, micro-batch, peer) operation was its own
    NCCL launch with its own event and watchdog entry. A `grouped_ops` block's operations
    go out at its end inside the communicator's group calls, one launch per communicator
    (in the order first used), one watchdog entry each; the caller's stream joins a launch
    once however many of its handles it waits for."""
    import torch

    send, recv = RecordingComm(), RecordingComm()
    t, watched = _bare_transport(send, recv)
    with t.grouped_ops():
        handles = [t.isend(torch.ones(2), peer, 0) for peer in (1, 2)]
        handles.append(t.irecv(torch.ones(2), 1, 0))
        with t.grouped_ops():  # nested: part of the outer block
            handles.append(t.isend(torch.ones(2), 1, 0))
        assert send.calls == [] and recv.calls == []  # nothing goes out inside the block
        with pytest.raises(RuntimeError, match="waited for inside its own grouped_ops block"):
            handles[0].wait()
    assert send.calls == ["group_start", ("send", 1), ("send", 2), ("send", 1), "group_end"]
    assert recv.calls == [("recv", 1)]  # a launch of one operation needs no group
    assert watched == ["send to group ranks 1, 2", "receive from group rank 1"]
    for h in handles:
        h.wait()
    assert t.runtime.waits == 2  # one join per launch
    t.isend(torch.ones(2), 2, 0).wait()  # outside a block: a launch of its own
    assert send.calls[-1] == ("send", 2) and watched[-1] == "send to group rank 2"
    assert t.runtime.waits == 3
    t._watchdog.stop()


def test_a_communicator_without_group_calls_gets_the_operations_one_by_one():
    import torch

    send = RecordingComm(group=False)
    t, watched = _bare_transport(send, RecordingComm(group=False))
    with t.grouped_ops():
        handles = [t.isend(torch.ones(2), peer, 0) for peer in (1, 2)]
    assert send.calls == [("send", 1), ("send", 2)]
    assert watched == ["send to group ranks 1, 2"]  # still one event for the launch
    for h in handles:
        h.wait()
    assert t.runtime.waits == 1
    t._watchdog.stop()


def test_a_failed_launch_closes_its_group_and_names_the_operations():
    """An operation that raises inside a group: ncclGroupEnd is still called (NCCL's group
    depth must go back to zero), and the error names the launch; nothing is watched."""
    import torch

    from afd_core.connectors.transports.transport import TransportError

    send = RecordingComm(fail_at=1)
    t, watched = _bare_transport(send, RecordingComm())
    failed = pytest.raises(TransportError, match=r"send to group ranks 1, 2: NCCL RuntimeError")
    with failed, t.grouped_ops():
        for peer in (1, 2):
            t.isend(torch.ones(2), peer, 0)
    assert send.calls == ["group_start", ("send", 1), "group_end"]
    assert watched == []
    t._watchdog.stop()


def test_vllms_pynccl_has_the_calls_the_nccl_connector_makes():
    """The nccl connector drives vLLM 0.32's PyNcclCommunicator built from a unique id:
    send/recv with an explicit stream, group_start/group_end, destroy (the abort)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    assert list(inspect.signature(PyNcclCommunicator.send).parameters) == [
        "self",
        "tensor",
        "dst",
        "stream",
    ]
    assert list(inspect.signature(PyNcclCommunicator.recv).parameters) == [
        "self",
        "tensor",
        "src",
        "stream",
    ]
    assert list(inspect.signature(PyNcclCommunicator.from_unique_id_bytes).parameters)[:4] == [
        "unique_id_bytes",
        "rank",
        "world_size",
        "device",
    ]
    for name in ("group_start", "group_end", "destroy"):
        assert list(inspect.signature(getattr(PyNcclCommunicator, name)).parameters) == ["self"]
