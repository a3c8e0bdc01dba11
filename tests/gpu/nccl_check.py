"""The CUDA path across real processes on one GPU: AFD's NCCL connector, FFN step server
and FFN graph cache with real NCCL, on a toy decoder that goes through AFD's exchange op.

Three processes share the GPU: FFN rank 0 and attention ranks 0 and 1 (one attention
server of two ranks, so every step carries two peers). NCCL refuses two ranks of one
communicator on one GPU only when it believes they are on one host: each process gets its
own NCCL_HOSTID, and NCCL talks over its socket transport on loopback (P2P and SHM off).
The communicator is vLLM's PyNccl where vLLM imports, else ours (tests/gpu/nccl_comm.py:
the same NCCL calls); the report names which ran.

Scenarios (each bounded; a scenario that hangs or breaks the deployment ends its session
and the rest run in a fresh one):

  a first_eager      the first step, eager (NCCL connects point-to-point pairs lazily)
  b microbatches     m = 2 on AFD's micro-batch threads, unequal and zero-row micro-batches,
                     against a reference computed locally; the threads run on the caller's stream
  c capture_replay   capture (both sides), then 20 replays with new inputs, equal to eager
  d recapture        the same key captured again (vLLM does at start-up): replays still right
  e failure          attention rank 0 fails micro-batch 1 at layer 0 with rows (4, 3): the
                     step fails on that rank only and the next step is right on both
  f dbo_capture      two micro-batch threads captured into one graph (global capture mode,
                     as vLLM's UBatchWrapper), replayed, equal to the unsplit reference
  g kill_ffn         the FFN process is killed during replays (each followed by a host sync,
                     as vLLM's sampler does): both attention ranks end with a named error
  h device_sync      the FFN's compute waits for the whole device (torch.cuda.synchronize,
                     as a lazily loaded kernel or a cudaMalloc may) inside eager m = 1 steps
  i capture_failure  a capture that fails on the attention side at layer 0, then at the last
                     layer: that step fails, nothing moved, the next steps are right
  j bucket_graphs    the FFN rank also captures each layer at padded row counts; steps no
                     whole-step graph matches replay them, equal to the reference
  k peer_restart     the attention ranks as two servers: rank 1's process exits in the middle
                     of a step; the FFN rank drops it (its link alone), rank 0's steps stay
                     right throughout, and a new rank-1 process rejoins and is served
  plus the exchange latency per layer (eager and replayed, timed with CUDA events) against
  a raw NCCL ping-pong of the same message on the same communicators, measured in the same
  run. Three processes share the one GPU (time-sliced, socket transport): the latencies are
  a smoke test, not what two GPUs would show.

Run: python tests/gpu/nccl_check.py [--out report.json]; `--cpu` runs the scenarios that
need no CUDA graph (a, b, e, g, h, j with a stand-in for its graphs, k) over the CPU
stand-ins of tests/afd_core/nccl_standin.py
(what the suite does, to keep this script working). Exit status 0 when all passed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT / "packages" / "afd-core" / "src", ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from afd_core.net import free_port  # noqa: E402 (the source tree is on the path now)

LAYERS = 4
HIDDEN = 1024
MAX_TOKENS = 64
ATTENTION_RANKS = 2
SCENARIO_S = 60.0  # per scenario
TOL = 1e-3  # relative to the reference's largest value (fp32; cuBLAS picks kernels by rows)
REPLAYS = 20
TIMED_STEPS = 30
PINGPONG = (20, 200)  # warm-up, timed round trips

SCENARIOS = {
    "a_first_eager": "first eager step",
    "b_microbatches": "m = 2, unequal and zero-row micro-batches",
    "c_capture_replay": "capture + 20 replays",
    "d_recapture": "the same key captured again",
    "e_failure": "failure at layer 0 with rows (4, 3)",
    "f_dbo_capture": "two micro-batch threads captured into one graph",
    "g_kill_ffn": "FFN process killed during replays",
    "h_device_sync": "a device-wide synchronize inside the FFN's step",
    "i_capture_failure": "a failed capture at layer 0 and at the last layer",
    "j_bucket_graphs": "layer graphs at padded row counts for uncaptured steps",
    "k_peer_restart": "an attention server crashes mid-step, its restart rejoins",
}
NEEDS_GRAPHS = {"c_capture_replay", "d_recapture", "f_dbo_capture", "i_capture_failure"}
SYNC_ROWS = 7  # h: the FFN synchronizes the device in eager steps of 2 x 7 rows
PROCESSES_ON_GPU = 1 + ATTENTION_RANKS


# -- each process ---------------------------------------------------------------------------


class Env:
    """One process's device, connector and toy model (the same weights in every process)."""

    def __init__(self, kind: str, name: str, timeout_s: float):
        if kind == "cuda":
            os.environ.update(
                NCCL_HOSTID=f"afd-check-{name}",  # one "host" per process: no duplicate-GPU refusal
                NCCL_P2P_DISABLE="1",
                NCCL_SHM_DISABLE="1",
                NCCL_IB_DISABLE="1",
                NCCL_NET="Socket",
                NCCL_SOCKET_IFNAME="lo",
            )
        import torch

        self.torch = torch
        self.kind = kind
        self.timeout_s = timeout_s
        if kind == "cuda":
            from afd_core.connectors.transports.device import CudaRuntime
            from tests.gpu.nccl_comm import factory

            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
            torch.cuda.set_stream(torch.cuda.Stream())  # vLLM's runner: a stream of its own
            self.runtime = CudaRuntime(self.device)
            self.factory = factory()
        else:
            from tests.afd_core.nccl_standin import HostRuntime, OrderedGlooFactory

            self.device = torch.device("cpu")
            self.runtime = HostRuntime()
            self.factory = None  # needs the port: made in connector()
            self._standin = OrderedGlooFactory
        gen = torch.Generator(device=self.device).manual_seed(0)

        def weights():
            return [
                torch.randn(HIDDEN, HIDDEN, device=self.device, generator=gen) / HIDDEN**0.5
                for _ in range(LAYERS)
            ]

        self.w_attn, self.w_ffn = weights(), weights()

    def connector(self, role: str, rank: int, port: int):
        from afd_core.config import parse_afd_config
        from afd_core.connectors.base import WireSpec
        from afd_core.connectors.nccl import NcclConnector

        cfg = parse_afd_config(
            {
                "connector": "nccl",
                "role": role,
                "host": "127.0.0.1",
                "port": port,
                "num_attention_ranks": ATTENTION_RANKS,
                "num_ffn_ranks": 1,
                "connector_extra_config": {"timeout_s": self.timeout_s, "connect_timeout_s": 60},
            },
            device_type="cuda",
        )
        wire = WireSpec(HIDDEN, "float32", LAYERS, MAX_TOKENS)
        factory = self.factory or self._standin("127.0.0.1", port)
        return NcclConnector(cfg, rank, wire, runtime=self.runtime, comm_factory=factory)

    def sync(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.synchronize()

    def wait_stream(self, stream) -> None:
        """Block the host until `stream` has run what is enqueued on it."""
        event = self.runtime.new_event()
        event.record(stream)
        if self.kind == "cuda":
            event.synchronize()
        else:
            event.wait_host(lambda: None)

    # the toy decoder: attention = x @ W_attn, FFN = relu(h @ W_ffn), residual
    def ffn_compute(self, layer, h, _logits=None, _ids=None):
        return self.torch.relu(h @ self.w_ffn[layer])

    def model(self, x, fail_at: int | None = None):
        from afd_core.exchange import ffn_exchange_op

        op = ffn_exchange_op()
        for layer in range(LAYERS):
            if layer == fail_at:
                raise RuntimeError(f"injected failure at layer {layer}")
            x = x + op(x @ self.w_attn[layer], layer, None, None)
        return x

    def device_sync(self) -> None:
        """Wait for everything enqueued on the device (HostRuntime's stand-in on CPU)."""
        if self.kind == "cuda":
            self.torch.cuda.synchronize()
        else:
            self.runtime.synchronize()

    def is_capturing(self) -> bool:
        return self.kind == "cuda" and self.torch.cuda.is_current_stream_capturing()

    def reference(self, x):
        for layer in range(LAYERS):
            x = x + self.ffn_compute(layer, x @ self.w_attn[layer])
        return x

    def rows(self, n: int, seed: int):
        gen = self.torch.Generator(device=self.device).manual_seed(seed)
        return self.torch.randn(n, HIDDEN, device=self.device, generator=gen)

    def error(self, out, x) -> float:
        """Largest difference from the local reference, relative to its largest value."""
        want = self.reference(x)
        self.sync()
        if want.numel() == 0:
            return 0.0 if out.numel() == 0 else float("inf")
        return ((out - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


class _DeviceTimer:
    """Elapsed time on the current stream with CUDA events (what the device did between
    two points, host jitter excluded); wall time on the CPU stand-ins."""

    def __init__(self, env):
        self.env = env
        self.kind = "cuda events" if env.kind == "cuda" else "wall clock"
        if env.kind == "cuda":
            torch = env.torch
            self.start, self.end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def ms(self) -> float:
        if self.env.kind == "cuda":
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return (time.perf_counter() - self.t0) * 1000


def _put(q, *msg) -> None:
    q.put(msg)


def _finish(q) -> None:
    q.close()
    q.join_thread()
    os._exit(0)  # no interpreter teardown: a dead peer's NCCL state must not hold us


def _pingpong(env, conn, attention: bool) -> dict:
    """Raw round trips of one 8-row message on the connector's own communicators and
    streams (attention rank 0 <-> FFN rank 0), before any AFD step."""
    torch = env.torch
    t = conn._transport
    buf = torch.ones(8, HIDDEN, device=env.device)
    back = torch.empty_like(buf)
    cur = env.runtime.current_stream()
    peer = 0 if attention else 1  # group ranks: the FFN rank, attention rank 0
    send_comm, send_stream, rank = t.endpoint(peer, send=True)
    recv_comm, recv_stream, _ = t.endpoint(peer, send=False)
    warm, timed = PINGPONG
    timer = None
    for i in range(warm + timed):
        if i == warm:
            env.sync()
            timer = _DeviceTimer(env)
        if attention:
            send_stream.wait_stream(cur)
            send_comm.send(buf, rank, send_stream)
            recv_comm.recv(back, rank, recv_stream)
            env.wait_stream(recv_stream)
        else:
            recv_comm.recv(back, rank, recv_stream)
            send_stream.wait_stream(recv_stream)
            send_comm.send(back, rank, send_stream)
            env.wait_stream(send_stream)
    rtt_us = timer.ms() * 1000 / timed
    return {"round_trip_us": round(rtt_us, 1), "bytes": buf.numel() * 4, "timed_with": timer.kind}


def ffn_main(kind, port, timeout_s, scenarios, q):
    try:
        env = Env(kind, "ffn0", timeout_s)
        from afd_core.step.ffn import FFNStepServer
        from afd_core.step.graphs import CudaGraphBackend, FFNGraphCache

        conn = env.connector("ffn", 0, port)
        conn.init()
        if "pingpong" in scenarios:
            _pingpong(env, conn, attention=False)
        log: list = []  # per step: [step, rows, flags, action]
        cache = None
        if kind == "cuda":

            class Logged(CudaGraphBackend):
                def capture(self, fn):
                    log[-1][3] = "capture"
                    return super().capture(fn)

                def replay(self, graph):
                    log[-1][3] = "replay"
                    super().replay(graph)

            cache = FFNGraphCache(Logged())
        syncs = []

        def compute(layer, h, logits=None, ids=None):
            # h: a host call that waits for the whole device inside the step
            if h.shape[0] == SYNC_ROWS * ATTENTION_RANKS and not env.is_capturing():
                env.device_sync()
                syncs.append(layer)
            return env.ffn_compute(layer, h, logits, ids)

        if "j_bucket_graphs" in scenarios:  # layer graphs at padded row counts
            from afd_core.step.ffn_buckets import FFNBucketGraphs, bucket_ladder

            if kind == "cuda":
                backend = CudaGraphBackend()
            else:  # the compute run again at replay, as a CUDA graph of it would
                from tests.afd_core.nccl_standin import RerunGraphBackend

                backend = RerunGraphBackend()
                cache = FFNGraphCache(backend)
            ladder = bucket_ladder(ATTENTION_RANKS * MAX_TOKENS)
            top = env.torch.zeros(ladder[-1], HIDDEN, device=env.device)
            cache.buckets = FFNBucketGraphs(backend, ladder)
            with env.torch.inference_mode():
                cache.buckets.capture(list(range(LAYERS)), env.ffn_compute, (top, None, None))
        server = FFNStepServer(conn, list(range(LAYERS)), compute, graphs=cache)
        recv = conn.recv_control

        def recording():
            plan = recv()
            log.append([plan.step, [list(r) for r in plan.rows], int(plan.flags), "eager"])
            return plan

        conn.recv_control = recording
        stopped = None
        try:
            while server.serve_step():
                pass
        except Exception as exc:  # noqa: BLE001 - reported
            stopped = f"{type(exc).__name__}: {exc}"
        _put(
            q,
            "ffn",
            0,
            "served",
            {
                "steps": server.steps,
                "failed_steps": server.failed_steps,
                "graphs": cache.stats.as_dict() if cache is not None else None,
                "log": log,
                "device_syncs": len(syncs),
                "buckets": (
                    cache.buckets.stats.as_dict()
                    if cache is not None and cache.buckets is not None
                    else None
                ),
                "lost": conn.peers_lost,
                "rejoined": conn.peers_rejoined,
                "stopped": stopped,
            },
        )
        conn.close()
    except Exception:  # noqa: BLE001
        _put(q, "ffn", 0, "error", {"ok": False, "error": traceback.format_exc()[-4000:]})
    _finish(q)


class Attention:
    """One attention rank's scenarios; both ranks run them in lockstep (one server)."""

    def __init__(self, env, conn, rank, q):
        from afd_core.step.attention import AttentionStepDriver

        self.env, self.conn, self.rank, self.q = env, conn, rank, q
        self.torch = env.torch
        self.driver = AttentionStepDriver(conn)
        self.seed = 1000 * rank

    def x(self, n):
        self.seed += 1
        return self.env.rows(n, self.seed)

    def step(self, rows, jobs, **kw):
        return self.driver.run(tuple(rows), jobs, **kw)

    # a
    def a_first_eager(self):
        n = 3 if self.rank == 0 else 5
        x = self.x(n)
        t0 = time.perf_counter()
        out = self.step((n,), [lambda: self.env.model(x)])[0]
        self.env.sync()
        ms = (time.perf_counter() - t0) * 1000
        err = self.env.error(out, x)
        return {"ok": err < TOL, "rel_error": err, "first_step_ms": round(ms, 2)}

    # b
    def b_microbatches(self):
        torch = self.torch
        plans = {0: [(5, 0), (3, 7), (0, 4)], 1: [(0, 6), (2, 2), (1, 0)]}[self.rank]
        caller = self.env.runtime.current_stream()
        on_stream = []
        errors = []
        for rows in plans:
            xs = [self.x(n) for n in rows]

            def job(x):
                def run():
                    if self.env.kind == "cuda":
                        on_stream.append(torch.cuda.current_stream() == caller)
                    return self.env.model(x)

                return run

            outs = self.step(rows, [job(x) for x in xs])
            errors += [self.env.error(o, x) for o, x in zip(outs, xs, strict=True)]
        ok = max(errors) < TOL and all(on_stream)
        return {
            "ok": ok,
            "steps": plans,
            "max_rel_error": max(errors),
            "jobs_on_callers_stream": f"{sum(on_stream)}/{len(on_stream)}",
        }

    # c
    def _capture(self, rows, body, split=False):
        """Capture `body` (both sides capture: the CAPTURE flag) after one eager warm-up
        step; returns (graph, holder with the output)."""
        from afd_core.connectors.protocol.control import ControlFlag

        torch = self.torch
        self.step(rows, [body], whole=split)  # warm-up, eager (vLLM warms up first too)
        graph = torch.cuda.CUDAGraph()
        holder = {}

        def capture():
            with torch.cuda.graph(graph):  # global capture mode, as vLLM's wrappers capture
                holder["out"] = body()

        self.step(rows, [capture], flags=ControlFlag.CAPTURE, whole=split)
        return graph, holder

    def _replays(self, rows, graph, holder, static, n, split=False):
        errors = []
        for _ in range(n):
            x = self.x(static.shape[0])
            static.copy_(x)
            self.step(rows, [graph.replay], replayed=True, whole=split)
            errors.append(self.env.error(holder["out"], x))
        return errors

    def c_capture_replay(self):
        rows = (8,)
        static = self.x(8)
        env = self.env
        # eager steps of this key first, timed: before the capture both sides run eagerly
        self.step(rows, [lambda: env.model(static)])
        env.sync()
        timer = _DeviceTimer(env)
        for _ in range(TIMED_STEPS):
            self.step(rows, [lambda: env.model(static)])
        eager_ms = timer.ms() / TIMED_STEPS
        graph, holder = self._capture(rows, lambda: env.model(static))
        errors = self._replays(rows, graph, holder, static, REPLAYS)
        self.graph = (graph, holder, static)
        timer = _DeviceTimer(env)
        for _ in range(TIMED_STEPS):
            self.step(rows, [graph.replay], replayed=True)
        replay_ms = timer.ms() / TIMED_STEPS
        return {
            "ok": max(errors) < TOL,
            "replays": len(errors),
            "max_rel_error": max(errors),
            "eager_step_ms": round(eager_ms, 3),
            "replay_step_ms": round(replay_ms, 3),
            "eager_per_layer_us": round(eager_ms * 1000 / LAYERS, 1),
            "replay_per_layer_us": round(replay_ms * 1000 / LAYERS, 1),
            "timed_with": timer.kind,
        }

    # d
    def d_recapture(self):
        rows = (8,)
        _, _, static = self.graph
        self.graph = None  # vLLM drops the profile's graphs before capturing again
        graph, holder = self._capture(rows, lambda: self.env.model(static))
        errors = self._replays(rows, graph, holder, static, 5)
        return {"ok": max(errors) < TOL, "replays": len(errors), "max_rel_error": max(errors)}

    # e
    def e_failure(self):
        from afd_core.connectors.base import AFDStepError

        rows = (4, 3) if self.rank == 0 else (2, 5)
        xs = [self.x(n) for n in rows]
        env = self.env

        def job(mb, x):
            def run():
                if self.rank == 0 and mb == 1:  # micro-batch 0 has exchanged layer 0
                    raise RuntimeError("injected attention failure at layer 0")
                return env.model(x)

            return run

        failed = None
        try:
            outs = self.step(rows, [job(mb, x) for mb, x in enumerate(xs)])
            first_errors = [env.error(o, x) for o, x in zip(outs, xs, strict=True)]
        except AFDStepError as exc:
            failed = str(exc)
            first_errors = []
        xs = [self.x(n) for n in rows]
        outs = self.step(rows, [lambda x=x: env.model(x) for x in xs])
        errors = [env.error(o, x) for o, x in zip(outs, xs, strict=True)]
        if self.rank == 0:
            ok = failed is not None and "injected attention failure" in failed
        else:
            ok = failed is None and max(first_errors) < TOL
        return {
            "ok": ok and max(errors) < TOL,
            "step_failed": failed,
            "next_step_max_rel_error": max(errors),
        }

    # f
    def f_dbo_capture(self):
        from afd_core.step.microbatch import MicrobatchExecutor

        torch = self.torch
        rows = (5, 3) if self.rank == 0 else (3, 5)
        static = self.x(8)
        inner = MicrobatchExecutor()  # the micro-batch threads, on the capturing stream
        env = self.env

        def split():
            a, b = static[: rows[0]], static[rows[0] :]
            return torch.cat(inner.run([lambda: env.model(a), lambda: env.model(b)]))

        graph, holder = self._capture(rows, split, split=True)
        errors = self._replays(rows, graph, holder, static, REPLAYS, split=True)
        t0 = time.perf_counter()
        for _ in range(TIMED_STEPS):
            self.step(rows, [graph.replay], replayed=True, whole=True)
        env.sync()
        replay_ms = (time.perf_counter() - t0) * 1000 / TIMED_STEPS
        inner.close()
        return {
            "ok": max(errors) < TOL,
            "replays": len(errors),
            "max_rel_error": max(errors),
            "replay_step_ms": round(replay_ms, 3),
        }

    # g
    def g_kill_ffn(self):
        rows = (8,)
        static = self.x(8)
        env = self.env
        if env.kind == "cuda":
            graph, holder = self._capture(rows, lambda: env.model(static))

            def one():
                self.step(rows, [graph.replay], replayed=True)
        else:

            def one():
                self.step(rows, [lambda: env.model(static)])

        t_start = time.time()
        n = 0
        try:
            while time.time() - t_start < 45:
                one()
                env.sync()  # the sampler's host sync after the forward
                n += 1
                if n == 10:
                    _put(self.q, "attention", self.rank, "progress", {"time": time.time()})
            return {"ok": False, "error": f"no error within 45 s ({n} steps)"}
        except Exception as exc:  # noqa: BLE001 - the named error is the result
            text = f"{type(exc).__name__}: {exc}"
            return {
                "ok": "FFN rank 0" in text or "no answer within" in text,
                "steps_before": n,
                "error": text[:600],
                "error_time": time.time(),
            }

    # h
    def h_device_sync(self):
        """Eager m = 1 steps of 7 rows per rank: the FFN synchronizes the device inside
        each layer's compute. With the next receive posted before the compute (the order
        before this fix) the synchronize would wait for rows that need this layer's send."""
        errors = []
        for _ in range(3):
            x = self.x(SYNC_ROWS)
            out = self.step((SYNC_ROWS,), [lambda x=x: self.env.model(x)])[0]
            errors.append(self.env.error(out, x))
        return {"ok": max(errors) < TOL, "steps": len(errors), "max_rel_error": max(errors)}

    # j
    def j_bucket_graphs(self):
        """Steps whose rows no whole-step graph matches (nobody captured them): the FFN
        rank replays each layer's graph at the bucket that holds the rows, padded; the
        outputs equal the reference."""
        plans = {0: [(5,), (3, 6), (1,)], 1: [(10,), (7, 2), (12,)]}[self.rank]
        errors = []
        for rows in plans:
            xs = [self.x(n) for n in rows]
            outs = self.step(rows, [lambda x=x: self.env.model(x) for x in xs])
            errors += [self.env.error(o, x) for o, x in zip(outs, xs, strict=True)]
        return {"ok": max(errors) < TOL, "steps": plans, "max_rel_error": max(errors)}

    # i
    def i_capture_failure(self):
        """A capture that fails on the attention side (layer 0, then the last layer): the
        step fails naming it and that nothing moved; the next step (eager here, a replay
        of the FFN's graph of the same key there) is right."""
        from afd_core.connectors.base import AFDStepError
        from afd_core.connectors.protocol.control import ControlFlag

        torch = self.torch
        rows = (6,)
        static = self.x(6)
        env = self.env
        self.step(rows, [lambda: env.model(static)])  # warm-up, eager
        out = {"failed": [], "next_errors": []}
        for fail_at in (0, LAYERS - 1):
            graph = torch.cuda.CUDAGraph()

            def capture(fail_at=fail_at, graph=graph):
                with torch.cuda.graph(graph):
                    return env.model(static, fail_at=fail_at)

            try:
                self.step(rows, [capture], flags=ControlFlag.CAPTURE)
                out["failed"].append(None)
            except AFDStepError as exc:
                out["failed"].append(str(exc)[:300])
            x = self.x(6)
            result = self.step(rows, [lambda x=x: env.model(x)])[0]
            out["next_errors"].append(env.error(result, x))
        ok = all(f and "nothing moved" in f for f in out["failed"])
        return {"ok": ok and max(out["next_errors"]) < TOL, **out}


def attention_main(kind, rank, port, timeout_s, scenarios, q):
    try:
        env = Env(kind, f"attn{rank}", timeout_s)
        from afd_core import dbo
        from afd_core.connectors.base import AFDPeerError
        from afd_core.runtime import install_connector

        dbo._vllm_ubatching()  # the yield op looks for vLLM once: not inside a timed step

        conn = env.connector("attention", rank, port)
        conn.init()
        install_connector(conn)
        if "pingpong" in scenarios:
            result = _pingpong(env, conn, attention=True) if rank == 0 else {}
            _put(q, "attention", rank, "pingpong", {"ok": True, **result})
        side = Attention(env, conn, rank, q)
        for name in scenarios:
            if name == "pingpong":
                continue
            t0 = time.perf_counter()
            fatal = False
            try:
                result = getattr(side, name)()
                fatal = name == "g_kill_ffn"
            except AFDPeerError as exc:
                result, fatal = {"ok": False, "error": f"AFDPeerError: {exc}"}, True
            except Exception:  # noqa: BLE001 - reported per scenario
                result = {"ok": False, "error": traceback.format_exc()[-4000:]}
            result["seconds"] = round(time.perf_counter() - t0, 2)
            _put(q, "attention", rank, name, result)
            if fatal:
                break
        else:
            side.driver.close()
            conn.close()
            _put(q, "attention", rank, "closed", {})
    except Exception:  # noqa: BLE001
        _put(q, "attention", rank, "error", {"ok": False, "error": traceback.format_exc()[-4000:]})
    _finish(q)


# -- k: an attention server lost and restarted ------------------------------------------------

RESTART_STEPS = 5  # steps the restarted rank-1 process must be served


def restart_attention(kind, rank, port, timeout_s, marks, role, q):
    """k. Each attention rank a server of its own. role "steady" (rank 0): steps until the
    restarted rank 1 was served (marks/again-done); "first" (rank 1): exits in the middle
    of its 4th step, layer 1's rows sent; "again" (rank 1): once the first is gone, joins
    the running deployment and runs RESTART_STEPS steps."""
    try:
        env = Env(kind, f"attn{rank}-{role}", timeout_s)
        from afd_core.exchange import ffn_exchange_op
        from afd_core.runtime import install_connector

        marks = Path(marks)
        if role == "again":
            deadline = time.monotonic() + SCENARIO_S
            while not (marks / "first-gone").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        conn = env.connector("attention", rank, port)
        conn.steps_with = rank  # a server of its own: it steps on its own
        t0 = time.monotonic()
        conn.init()
        joined_s = time.monotonic() - t0
        install_connector(conn)
        side = Attention(env, conn, rank, q)
        errors = []

        def one(step):
            x = side.x(4)
            if role == "first" and step == 3:

                def crash():
                    op = ffn_exchange_op()
                    op(x @ env.w_attn[0], 0, None, None)  # layer 0 exchanged
                    conn.start_exchange(x @ env.w_attn[1], 1, 0)  # layer 1's rows sent
                    env.sync()
                    (marks / "first-gone").touch()
                    os._exit(3)  # a crash: no goodbye, a step half done

                side.step((4,), [crash])
            out = side.step((4,), [lambda: env.model(x)])[0]
            errors.append(env.error(out, x))

        if role == "steady":
            deadline = time.monotonic() + 2 * SCENARIO_S
            while not (marks / "again-done").exists() and time.monotonic() < deadline:
                one(len(errors))
                time.sleep(0.01)
        else:
            for step in range(RESTART_STEPS):
                one(step)
            if role == "again":
                (marks / "again-done").touch()
        side.driver.close()
        conn.close()
        ok = bool(errors) and max(errors) < TOL
        _put(q, "attention", rank, f"k-{role}", {"ok": ok, "steps": len(errors),
             "max_rel_error": max(errors, default=0.0), "joined_s": round(joined_s, 2)})  # fmt: skip
    except Exception:  # noqa: BLE001
        (Path(marks) / "again-done").touch()
        _put(
            q,
            "attention",
            rank,
            f"k-{role}",
            {"ok": False, "error": traceback.format_exc()[-3000:]},
        )
    _finish(q)


def run_restart_session(kind, timeout_s, log) -> tuple[dict, dict]:
    """k: (the scenario's result, the FFN rank's report)."""
    import tempfile

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    marks = tempfile.mkdtemp(prefix="afd-k-")
    procs = [ctx.Process(target=ffn_main, args=(kind, port, timeout_s, [], q))]
    for rank, role in ((0, "steady"), (1, "first"), (1, "again")):
        args = (kind, rank, port, timeout_s, marks, role, q)
        procs.append(ctx.Process(target=restart_attention, args=args))
    for p in procs:
        p.start()
    got, ffn = {}, {}
    deadline = time.monotonic() + 2 * SCENARIO_S + 60
    while len(got) < 2 or not ffn:  # steady and again report; the first never does
        try:
            role, _, name, body = q.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            got.setdefault("error", f"no answer within {2 * SCENARIO_S:.0f}s: a hang")
            break
        if role == "ffn":
            ffn = body
        else:
            got[name] = body
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    steady, again = got.get("k-steady", {}), got.get("k-again", {})
    ok = bool(steady.get("ok") and again.get("ok")) and ffn.get("stopped") is None
    ok = ok and ffn.get("lost") == [1] and ffn.get("rejoined") == [1]  # attention rank 1
    result = {"ok": ok, "attention0": steady, "attention1": again}
    if "error" in got:
        result["error"] = got["error"]
    log(f"  k_peer_restart: restarted rank served {again.get('steps')} steps, joined in "
        f"{again.get('joined_s')} s")  # fmt: skip
    return result, ffn


# -- the parent ---------------------------------------------------------------------------


def run_session(kind, scenarios, timeout_s, log) -> tuple[dict, list[str], dict]:
    """One deployment running `scenarios` in order: (results by scenario, the scenarios it
    did not get to, what the FFN rank reported)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    todo = ["pingpong", *scenarios]
    procs = {"ffn": ctx.Process(target=ffn_main, args=(kind, port, timeout_s, todo, q))}
    for r in range(ATTENTION_RANKS):
        procs[f"attn{r}"] = ctx.Process(
            target=attention_main, args=(kind, r, port, timeout_s, todo, q)
        )
    for p in procs.values():
        p.start()
    got: dict[str, dict[int, dict]] = {}
    ffn = {}
    results: dict[str, dict] = {}
    deadline = time.monotonic() + SCENARIO_S + 60  # start-up: imports, CUDA, NCCL
    current = 0
    killed_at = None
    ended = set()
    while len(ended) < len(procs):
        try:
            role, rank, name, body = q.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            name = todo[current] if current < len(todo) else "closing"
            results[name] = {
                "ok": False,
                "error": f"no answer within {SCENARIO_S:.0f}s: a hang (processes killed)",
                **{f"attention{r}": b for r, b in got.get(name, {}).items()},
            }
            log(f"  {name}: timed out, killing the session")
            break
        if role == "ffn":
            ffn = body
            ended.add("ffn")
            continue
        if name in ("closed", "error"):
            ended.add(f"attn{rank}")
            if name == "error":
                results.setdefault("session", body)
                break
            continue
        if name == "progress":  # g: the attention ranks replay; kill the FFN now
            if killed_at is None:
                killed_at = time.time()
                os.kill(procs["ffn"].pid, signal.SIGKILL)
                ended.add("ffn")
                log("  g_kill_ffn: FFN process killed during replays")
            continue
        got.setdefault(name, {})[rank] = body
        if str(body.get("error", "")).startswith("AFDPeerError"):
            deadline = min(deadline, time.monotonic() + 10)  # the other rank fails soon too
        if len(got[name]) == ATTENTION_RANKS:
            both = got[name]
            results[name] = {
                "ok": all(b.get("ok") for b in both.values()),
                **{f"attention{r}": b for r, b in sorted(both.items())},
            }
            if name == "g_kill_ffn":
                # passed only if the error came after the kill, not before it. Rank 0
                # reports after its 10th step; rank 1 may still be returning from its
                # own 10th (the FFN rank answered both), so it counts 9 or 10.
                results[name]["ok"] &= killed_at is not None and all(
                    b.get("steps_before", 0) >= 9 and b.get("error_time", 0) >= killed_at
                    for b in both.values()
                )
                if killed_at is not None:
                    results[name]["error_after_kill_s"] = round(
                        max(b.get("error_time", killed_at) for b in both.values()) - killed_at, 2
                    )
            current = todo.index(name) + 1
            deadline = time.monotonic() + SCENARIO_S
            if not results[name]["ok"] and any(
                str(b.get("error", "")).startswith("AFDPeerError") for b in both.values()
            ):
                break  # the deployment is broken: the rest run in a new one
            if name == "g_kill_ffn":
                ended.update(procs)
    for p in procs.values():
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    not_run = [s for s in scenarios if s not in results]
    return results, not_run, ffn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("--cpu", action="store_true", help="CPU stand-ins, no-graph scenarios")
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS))
    args = ap.parse_args(argv)
    import torch

    kind = "cpu" if args.cpu else "cuda"
    if kind == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the stand-ins", file=sys.stderr)
        return 2
    wanted = args.only or list(SCENARIOS)
    skipped = {s: "needs CUDA graphs" for s in wanted if kind == "cpu" and s in NEEDS_GRAPHS}
    wanted = [s for s in wanted if s not in skipped]
    report: dict = {"kind": kind, "torch": torch.__version__}
    if kind == "cuda":
        from tests.gpu.nccl_comm import factory

        f = factory()
        report |= {
            "device": torch.cuda.get_device_name(0),
            "cuda": torch.version.cuda,
            "communicator": f.name,
            "nccl": f.nccl.version() if hasattr(f, "nccl") else None,
        }

    def log(text):
        print(text, flush=True)

    log(f"AFD NCCL check on {report.get('device', 'CPU stand-ins')}: {len(wanted)} scenarios")
    t_all = time.perf_counter()
    results: dict = {}
    ffn_reports = []
    # g kills its FFN process: a session of its own, last; j (an FFN rank with layer
    # graphs) and k (its own deployment) before
    alone = ("g_kill_ffn", "j_bucket_graphs", "k_peer_restart")
    queue_ = [s for s in wanted if s not in alone]
    sessions = [queue_] + [[s] for s in ("j_bucket_graphs", "g_kill_ffn") if s in wanted]
    pingpong = None
    for session in sessions:
        todo = list(session)
        while todo:
            got, todo, ffn = run_session(kind, todo, 10.0 if "g_kill_ffn" in todo else 30.0, log)
            ffn_reports.append(ffn)
            pingpong = pingpong or got.get("pingpong")
            report.setdefault("pingpong", got.pop("pingpong", None))
            got.pop("closing", None)
            if "session" in got:
                results.setdefault("session_errors", []).append(got.pop("session"))
                if not got:  # nothing ran: do not loop on a broken start-up
                    for s in todo:
                        results[s] = {"ok": False, "error": "the session did not start"}
                    todo = []
            results |= got
            if not got and todo:
                break
    if "k_peer_restart" in wanted:
        results["k_peer_restart"], ffn_k = run_restart_session(kind, 10.0, log)
        results["k_peer_restart"]["ffn"] = {
            k: ffn_k.get(k) for k in ("steps", "stopped", "lost", "rejoined")
        }
    ffn_last = [f for f in ffn_reports if f]
    report["ffn"] = ffn_last
    report["processes_on_gpu"] = PROCESSES_ON_GPU if kind == "cuda" else None
    if kind == "cuda" and ffn_last:
        # the FFN rank captured on every CAPTURE step (and never ran one eagerly)
        captures = [e for f in ffn_last for e in f.get("log", []) if e[2] & 2]
        report["ffn_capture_steps"] = [e[3] for e in captures]
        replays = sum(1 for f in ffn_last for e in f.get("log", []) if e[3] == "replay")
        report["ffn_replays"] = replays
        c = results.get("c_capture_replay")
        if c is not None and c.get("ok"):
            # equal outputs alone would pass with an FFN that never replays: c's replays
            # (REPLAYS checked + TIMED_STEPS timed) must have been replays on the FFN too
            captured_all = all(a == "capture" for a in report["ffn_capture_steps"])
            c["ffn_replayed"] = replays
            c["ok"] = captured_all and replays >= REPLAYS + TIMED_STEPS
            if not c["ok"]:
                c["error"] = (
                    f"the FFN replayed {replays} steps (c alone needs {REPLAYS + TIMED_STEPS}) "
                    f"and ran its CAPTURE steps as {report['ffn_capture_steps']}"
                )
    j = results.get("j_bucket_graphs")
    if j is not None and j.get("ok"):
        replayed = sum((f.get("buckets") or {}).get("replayed", 0) for f in ffn_last)
        j["ffn_bucket_replays"] = replayed
        j["ok"] = replayed == 4 * LAYERS  # every layer of the 4 micro-batches (3 steps)
    h = results.get("h_device_sync")
    if h is not None and h.get("ok"):
        syncs = sum(f.get("device_syncs", 0) for f in ffn_last)
        h["ffn_device_syncs"] = syncs
        h["ok"] = syncs >= 3 * LAYERS  # the FFN did wait for the device in every layer
    for name in wanted:
        r = results.setdefault(name, {"ok": False, "error": "not run"})
        detail = {k: v for k, v in r.items() if not k.startswith("attention")}
        detail |= {
            k: v
            for r_ in (r.get("attention0", {}),)
            for k, v in r_.items()
            if k not in ("ok", "error", "error_time")
        }
        line = "PASS" if r["ok"] else "FAIL"
        log(f"{line} {name}: {SCENARIOS[name]} {json.dumps(detail, default=str)[:400]}")
        if not r["ok"]:
            for key in ("error", "attention0", "attention1"):
                if key in r:
                    log(f"    {key}: {json.dumps(r[key], default=str)[:1500]}")
    for name, why in skipped.items():
        results[name] = {"ok": None, "skipped": why}
        log(f"SKIP {name}: {why}")
    # latency per layer against the raw ping-pong of the same message
    c = results.get("c_capture_replay", {}).get("attention0", {})
    rtt = (pingpong or {}).get("attention0", {}).get("round_trip_us")
    if rtt and c.get("eager_per_layer_us"):
        report["latency"] = {
            "raw_nccl_round_trip_us": rtt,
            "eager_exchange_per_layer_us": c["eager_per_layer_us"],
            "replayed_exchange_per_layer_us": c["replay_per_layer_us"],
            "eager_vs_raw": round(c["eager_per_layer_us"] / rtt, 2),
            "replayed_vs_raw": round(c["replay_per_layer_us"] / rtt, 2),
        }
        log(f"latency: {json.dumps(report['latency'])}")
    elif pingpong:
        report["latency"] = {"raw": pingpong}
    if report.get("latency"):
        report["latency"]["note"] = (
            f"smoke only: {PROCESSES_ON_GPU} processes time-slice one GPU over NCCL's socket "
            "transport; two GPUs over NVLink would show the real figures"
        )
    report["scenarios"] = results
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    passed = sum(1 for n in wanted if results[n]["ok"])
    failed = len(wanted) - passed
    log(f"{passed} passed, {failed} failed, {len(skipped)} skipped in {report['seconds']}s")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
