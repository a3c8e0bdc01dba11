"""The CUDA path's single-process device checks, for one GPU with PyTorch and no vLLM.

The cross-process NCCL path (two or three processes sharing the GPU, each with its own
NCCL_HOSTID) is tests/gpu/nccl_check.py; tests/gpu/run.sh runs both. Here, in one process,
with AFD's real code:

1. `exchange_op_graph`: the attention side's exchange op (torch.ops.afd.ffn_exchange)
   inside a toy decoder captured in one CUDA graph, over a same-process loopback connector
   whose "FFN" computes on a second stream with AFD's device handles (fork/join by events);
   replayed with new inputs, compared with eager, timed.
2. `ffn_graph_cache`: AFD's FFNGraphCache with the CUDA backend around a layers x
   micro-batches loop of MoE-sized compute reading fixed receive buffers: capture on the
   CAPTURE flag, replay a known key, eager on an unknown key; compared and timed.
3. `nccl_transport`: AFD's NcclTransport on the CUDA runtime with a communicator that
   enqueues device work (no second rank): a send/receive wait orders the caller's stream
   without a host wait, a captured operation is not watched, and an operation held past
   the timeout by a long kernel trips the watchdog into the named error.
4. `microbatch_threads_graph`: DBO with graphs as vLLM's UBatchWrapper captures it (AFD's
   step/vllm_ubatch.py; vLLM itself is not on the device): two micro-batch threads on the
   capturing stream hand over at the yield inside the exchange op, and both are captured
   into one graph; the exchanges must interleave layer-major, micro-batch-minor; replayed
   with new inputs, compared with the eager unsplit model, timed.

Run: python tests/gpu/check.py [--out results.json]; exit status 0 when every check
passed. Nothing here needs vLLM; it imports afd_core from this checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packages" / "afd-core" / "src"))

import torch  # noqa: E402


def _time(fn, n: int) -> float:
    """Mean milliseconds of fn over n runs (after one warm-up), device-synchronized."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / n


# -- 1. the exchange op in a CUDA graph --------------------------------------------------


class LoopbackExchange:
    def __init__(self, runtime, event, out):
        self.out = out
        self._runtime, self._event = runtime, event

    def wait(self):
        # the caller's stream waits for the FFN stream's event (no host wait)
        self._runtime.wait_event(self._event, lambda: None)
        return self.out


class LoopbackConnector:
    """What the attention side's op calls: the "FFN" is this process's second stream."""

    def __init__(self, weights, runtime):
        self.weights = weights  # per layer [hidden, hidden]
        self.runtime = runtime
        self.ffn_stream = runtime.new_stream()
        self.calls = 0
        self.order = []  # (layer, micro-batch) of each exchange, in the order started

    def start_exchange(self, rows, layer, microbatch=0, router_logits=None, token_ids=None):
        self.calls += 1
        self.order.append((layer, microbatch))
        rt = self.runtime
        # the output buffer comes from the caller's stream (a capture's memory pool), as
        # the connector's receive buffer does; the FFN stream writes into it
        out = torch.empty_like(rows)
        self.ffn_stream.wait_stream(rt.current_stream())
        with torch.cuda.stream(self.ffn_stream):
            torch.matmul(rows, self.weights[layer], out=out)
            out.relu_()
        event = rt.new_event()
        event.record(self.ffn_stream)
        return LoopbackExchange(rt, event, out)


def _loopback_decoder(layers: int, hidden: int, seed: int):
    """A toy decoder whose every layer goes through AFD's exchange op to a loopback
    connector, installed for this process: (model, connector, generator)."""
    from afd_core.connectors.transports.device import CudaRuntime
    from afd_core.exchange import ffn_exchange_op
    from afd_core.runtime import install_connector

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)

    def weights():
        return [
            torch.randn(hidden, hidden, device=dev, generator=gen) / hidden**0.5
            for _ in range(layers)
        ]

    attn_w, ffn_w = weights(), weights()
    conn = LoopbackConnector(ffn_w, CudaRuntime(dev))
    install_connector(conn)
    op = ffn_exchange_op()

    def model(x):
        for layer in range(layers):
            x = x + op(x @ attn_w[layer], layer, None, None)
        return x

    return model, conn, gen


def _replay_error(graph, static_in, static_out, reference, gen, n: int = 3) -> float:
    """The largest difference between the graph's replays and `reference` run eagerly, over
    n new inputs copied into the captured input."""
    errors = []
    for _ in range(n):
        x = torch.randn(static_in.shape, device=static_in.device, generator=gen)
        static_in.copy_(x)
        graph.replay()
        want = reference(x)
        torch.cuda.synchronize()
        errors.append((static_out - want).abs().max().item())
    return max(errors)


def exchange_op_graph(tokens=256, hidden=2048, layers=8) -> dict:
    from afd_core.runtime import install_connector

    model, conn, gen = _loopback_decoder(layers, hidden, seed=0)
    dev = torch.device("cuda")
    static_in = torch.randn(tokens, hidden, device=dev, generator=gen)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the default stream, as capture requires
        for _ in range(2):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    calls_before = conn.calls
    with torch.cuda.graph(graph):
        static_out = model(static_in)
    captured_calls = conn.calls - calls_before
    error = _replay_error(graph, static_in, static_out, model, gen)
    calls_after_replays = conn.calls
    eager_ms = _time(lambda: model(static_in), 20)
    graph_ms = _time(graph.replay, 20)
    install_connector(None)
    replay_calls = calls_after_replays - calls_before - captured_calls - 3 * layers
    # (no Python can run in a replay, so the count of op calls during replays is a record,
    # not a check; the replays' outputs are what shows the exchanges ran)
    ok = error < 1e-3 and captured_calls == layers
    return {
        "ok": ok,
        "layers": layers,
        "ops_captured": captured_calls,
        "python_calls_during_replays": replay_calls,
        "max_abs_error_vs_eager": error,
        "eager_ms": round(eager_ms, 3),
        "graph_replay_ms": round(graph_ms, 3),
        "speedup": round(eager_ms / graph_ms, 2),
    }


# -- 2. the FFN graph cache with MoE-sized compute ---------------------------------------


def ffn_graph_cache(
    rows=(64, 64), hidden=2048, inter=1408, experts=16, topk=4, layers=8, mbs=2
) -> dict:
    from afd_core.connectors.base import StepPlan
    from afd_core.connectors.protocol.control import ControlFlag
    from afd_core.step.graphs import CudaGraphBackend, FFNGraphCache

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1)
    total = sum(rows)
    w_gate = [
        torch.randn(hidden, experts, device=dev, dtype=dtype, generator=gen) / hidden**0.5
        for _ in range(layers)
    ]
    w_up = [
        torch.randn(experts, hidden, inter, device=dev, dtype=dtype, generator=gen) / hidden**0.5
        for _ in range(layers)
    ]
    w_down = [
        torch.randn(experts, inter, hidden, device=dev, dtype=dtype, generator=gen) / inter**0.5
        for _ in range(layers)
    ]
    # fixed receive buffers (as NcclConnector allocates them once) and fixed output buffers
    recv = [torch.randn(total, hidden, device=dev, dtype=dtype, generator=gen) for _ in range(mbs)]
    outs = [torch.empty(total, hidden, device=dev, dtype=dtype) for _ in range(mbs)]

    def moe(layer, h):
        # top-k routing, then every expert over every token weighted by the routing (dense
        # stand-in for a grouped GEMM: the same kernels each step, MoE-sized FLOPs)
        probs = torch.softmax((h @ w_gate[layer]).float(), -1)
        weights, idx = torch.topk(probs, topk)
        dense = torch.zeros_like(probs).scatter_(1, idx, weights).to(dtype)  # [t, E]
        up = torch.nn.functional.silu(torch.einsum("th,ehi->eti", h, w_up[layer]))
        down = torch.einsum("eti,eih->eth", up, w_down[layer])
        return (down * dense.t().unsqueeze(-1)).sum(0)

    def run_layers(capturing=False):
        for layer in range(layers):
            for mb in range(mbs):
                outs[mb].copy_(moe(layer, recv[mb]))
        return None

    stream = torch.cuda.Stream()
    cache = FFNGraphCache(CudaGraphBackend())
    key_rows = tuple(rows for _ in range(mbs))
    settled = []
    with torch.cuda.stream(stream):
        run_layers()  # warm-up (the attention side's warm-up steps run eagerly too)
        torch.cuda.synchronize()
        cache.run(
            StepPlan(0, (), key_rows, ControlFlag.CAPTURE), run_layers, lambda: settled.append(1)
        )
        want = []
        for _ in range(2):
            for b in recv:
                b.copy_(torch.randn(total, hidden, device=dev, dtype=dtype, generator=gen))
            run_layers()
            torch.cuda.synchronize()
            want = [o.clone() for o in outs]
            for o in outs:
                o.zero_()
            cache.run(StepPlan(1, (), key_rows, ControlFlag.NONE), run_layers, lambda: None)
            torch.cuda.synchronize()
        err = max(
            (o.float() - w.float()).abs().max().item() for o, w in zip(outs, want, strict=True)
        )
        other = tuple((rows[0] + 1, rows[1]) for _ in range(mbs))
        cache.run(StepPlan(2, (), other, ControlFlag.NONE), run_layers, lambda: None)
        eager_ms = _time(run_layers, 10)
        replay_ms = _time(
            lambda: cache.run(
                StepPlan(3, (), key_rows, ControlFlag.NONE), run_layers, lambda: None
            ),
            10,
        )
    stats = cache.stats.as_dict()
    ok = err < 5e-2 and stats["captured"] == 1 and stats["eager"] == 1 and settled == [1]
    return {
        "ok": ok,
        "shape": {
            "rows_per_peer": rows,
            "microbatches": mbs,
            "layers": layers,
            "hidden": hidden,
            "experts": experts,
            "topk": topk,
            "intermediate": inter,
            "dtype": str(dtype),
        },
        "stats_after": stats,
        "max_abs_error_replay_vs_eager": err,
        "eager_step_ms": round(eager_ms, 3),
        "replay_step_ms": round(replay_ms, 3),
        "speedup": round(eager_ms / replay_ms, 2),
    }


# -- 3. the NCCL transport's device handles and watchdog ---------------------------------


class DeviceWorkComm:
    """A communicator stand-in that enqueues real device work on the given stream: a copy
    (a receive "arrives"), or a long sleep kernel (a peer that does not answer)."""

    def __init__(self):
        self.stall_cycles = 0

    def send(self, tensor, peer, stream):
        with torch.cuda.stream(stream):
            if self.stall_cycles:
                torch.cuda._sleep(self.stall_cycles)
            tensor.add_(0)

    def recv(self, tensor, peer, stream):
        with torch.cuda.stream(stream):
            tensor.fill_(float(peer + 1))

    def abort(self):
        pass


def nccl_transport(timeout_s=1.0) -> dict:
    from afd_core.connectors.transports.device import ChannelAborted, CudaRuntime, Watchdog
    from afd_core.connectors.transports.nccl import NcclTransport

    dev = torch.device("cuda")
    runtime = CudaRuntime(dev)
    t = NcclTransport(
        "127.0.0.1", 1, 0, 1, 2, False, timeout_s, timeout_s, runtime=runtime, comm_factory=None
    )
    comm = DeviceWorkComm()
    t._comms = {"to_first": comm, "from_first": comm}
    t._send_comm = t._recv_comm = comm
    t._send_stream, t._recv_stream = runtime.new_stream(), runtime.new_stream()
    t._watchdog = Watchdog("check", t._expired, runtime.thread_init)
    out = {}
    # a receive: the caller's stream is ordered after it, the host does not wait
    buf = torch.zeros(1024, device=dev)
    h = t.irecv(buf, 0, 0)
    t0 = time.perf_counter()
    h.wait()
    out["wait_host_ms"] = round((time.perf_counter() - t0) * 1000, 3)
    out["received_value"] = buf[0].item()  # the caller's stream saw the receive's data
    # captured operations are not put under the watchdog (count its watch calls, once the
    # eager receive above has left it)
    deadline = time.monotonic() + 2
    while t._watchdog.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    watched = []
    real_watch = t._watchdog.watch
    t._watchdog.watch = lambda ev, what, to: (watched.append(what), real_watch(ev, what, to))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static = torch.zeros(1024, device=dev)
        torch.cuda.synchronize()
        # global mode, as vLLM captures: the watchdog thread (thread-local capture mode,
        # CudaRuntime.thread_init) may query its events meanwhile
        with torch.cuda.graph(g, stream=s):
            t.irecv(static, 2, 0).wait()
            t.isend(static, 0, 0).wait()
    t._watchdog.watch = real_watch
    g.replay()
    torch.cuda.synchronize()
    out["captured_ops_watched"] = len(watched)
    out["replayed_receive_value"] = static[0].item()
    # a send held past the timeout by a long kernel: the watchdog names it
    # ~3 s of spinning at an H100's boost clock (6e9 cycles at ~2 GHz), three times the 1 s
    # bound: the send is still held when the watchdog looks
    comm.stall_cycles = int(6e9)
    t0 = time.perf_counter()
    handle = t.isend(torch.ones(8, device=dev), 1, 0)
    try:
        while time.perf_counter() - t0 < timeout_s + 5:
            handle.wait()
            time.sleep(0.05)
        out["watchdog"] = "did not fire"
    except ChannelAborted as exc:
        out["watchdog"] = str(exc)
        out["watchdog_fired_after_s"] = round(time.perf_counter() - t0, 2)
    torch.cuda.synchronize()
    ok = (
        out["received_value"] == 1.0
        and out["replayed_receive_value"] == 3.0
        and out["captured_ops_watched"] == 0
        and "no answer within 1s" in out["watchdog"]
        and out["wait_host_ms"] < 50
    )
    return {"ok": ok, **out}


# -- 4. two micro-batches captured in one graph ------------------------------------------


def microbatch_threads_graph(tokens=256, hidden=2048, layers=8) -> dict:
    from afd_core.runtime import install_connector
    from afd_core.step.microbatch import MicrobatchExecutor

    model, conn, gen = _loopback_decoder(layers, hidden, seed=1)
    dev = torch.device("cuda")
    executor = MicrobatchExecutor()  # the hand-over at the yield, as vLLM's UBatchContext
    stream = torch.cuda.Stream()  # the capturing stream, every micro-batch thread's
    half = tokens // 2

    def split(x):
        def job(i):
            def run():
                torch.cuda.set_stream(stream)  # as vLLM's UBatchContext does per thread
                return model(x[i * half : (i + 1) * half])

            return run

        return torch.cat(executor.run([job(0), job(1)]))

    static_in = torch.randn(tokens, hidden, device=dev, generator=gen)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            split(static_in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    conn.order.clear()
    with torch.cuda.graph(graph, stream=stream):
        static_out = split(static_in)
    captured_order = list(conn.order)
    error = _replay_error(graph, static_in, static_out, model, gen)  # vs unsplit, eager
    with torch.cuda.stream(stream):
        eager_ms = _time(lambda: split(static_in), 10)
    graph_ms = _time(graph.replay, 20)
    executor.close()
    install_connector(None)
    expected_order = [(layer, mb) for layer in range(layers) for mb in (0, 1)]
    ok = error < 1e-3 and captured_order == expected_order
    return {
        "ok": ok,
        "exchange_order_interleaved": captured_order == expected_order,
        "max_abs_error_vs_unsplit_eager": error,
        "eager_split_ms": round(eager_ms, 3),
        "graph_replay_ms": round(graph_ms, 3),
        "speedup": round(eager_ms / graph_ms, 2),
    }


CHECKS = {
    "exchange_op_graph": exchange_op_graph,
    "ffn_graph_cache": ffn_graph_cache,
    "nccl_transport": nccl_transport,
    "microbatch_threads_graph": microbatch_threads_graph,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--only", choices=sorted(CHECKS), action="append")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs one GPU", file=sys.stderr)
        return 2
    results = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    t_all = time.perf_counter()
    for name in args.only or CHECKS:
        t0 = time.perf_counter()
        try:
            results[name] = CHECKS[name]()
        except Exception:  # noqa: BLE001 - reported per check
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    results["seconds"] = round(time.perf_counter() - t_all, 2)
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(results[n]["ok"] for n in (args.only or CHECKS)) else 1


if __name__ == "__main__":
    sys.exit(main())
