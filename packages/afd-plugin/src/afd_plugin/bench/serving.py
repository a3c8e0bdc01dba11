"""AFD vs colocated on real vLLM servers: time per output token and decode step time.

Either running servers (any machine: a colocated one and a 1A1F AFD deployment) or three
started here: colocated (every core), and an AFD deployment of one attention and one FFN
server (attention on core 0, FFN on core 1, one thread each, when there are two cores).
The attention server starts DBO-capable and switches its micro-batch
count at run time, so AFD m = 1 (DBO off) and m = 2 (DBO on) run on the same servers, in
turn, for every repetition. One measurement is one batch of B requests added while the
scheduler is paused: TPOT = (t(SHORT + N tokens) - t(SHORT tokens)) / N, so the prefill
cancels out. The AFD servers write step timelines (AFD_STEP_TRACE): the decode step time is
the median forward step of the attention side (the first two steps, the prefill, left out).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROMPT = "Attention and the feed-forward network"
SHORT = 8  # tokens of the short run, whose time (with the prefill) is subtracted
CONFIGS = (("colocated", None), ("AFD m=1", 1), ("AFD m=2", 2))


@dataclass
class Window:
    """What one AFD run's timelines say about its decode steps."""

    steps: list[float] = field(default_factory=list)  # forward step durations
    busy: list[float] = field(default_factory=list)  # attention step time not waiting
    intervals: list[float] = field(default_factory=list)  # step start to next step start
    ffn_compute: list[float] = field(default_factory=list)  # one layer, one micro-batch


def _events(path: Path, start: float, end: float) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if start <= e["t0"] and e["t1"] <= end:
            out.append(e)
    return out


def read_window(trace: str, start: float, end: float) -> Window:
    att = _events(Path(f"{trace}.attention0.jsonl"), start, end)
    ffn = _events(Path(f"{trace}.ffn0.jsonl"), start, end)
    steps = sorted((e["t0"], e["t1"]) for e in att if e["kind"] == "step")[2:]
    waits = [(e["t0"], e["t1"]) for e in att if e["kind"] == "wait"]
    w = Window()
    for t0, t1 in steps:
        waited = sum(b - a for a, b in waits if t0 <= a and b <= t1)
        w.steps.append(t1 - t0)
        w.busy.append(t1 - t0 - waited)
    w.intervals = [b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False)]
    if steps:
        first, last = steps[0][0], steps[-1][1]
        w.ffn_compute = [
            e["t1"] - e["t0"]
            for e in ffn
            if e["kind"] == "compute" and first <= e["t0"] and e["t1"] <= last
        ]
    return w


def _batch_run(url: str, batch: int, tokens: int) -> tuple[float, float, float]:
    """(seconds, start, end) of one batch of `batch` requests generating `tokens` each."""
    from afd_plugin.deploy.servers import complete_batch

    prompts = [f"{PROMPT} {i}" for i in range(batch)]
    _, seconds = complete_batch(url, prompts, tokens, stagger=0)
    end = time.monotonic()
    return seconds, end - seconds, end


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def local_servers(model_dir: str, max_batch: int, log_dir: Path) -> tuple[list, str, str, str]:
    """(servers, colocated url, attention url, trace prefix) of this machine's deployment,
    not started yet."""
    from afd_plugin.deploy.servers import Server, ServerSpec, free_port

    trace = str(log_dir / "trace")
    two_cores = (os.cpu_count() or 1) >= 2
    common = ["--max-num-seqs", str(max_batch), "--max-model-len", "512"]
    one = {"OMP_NUM_THREADS": "1"}
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause, /resume and collective_rpc

    def bind(cores: str) -> dict:
        return {"VLLM_CPU_OMP_THREADS_BIND": cores if two_cores else "nobind"}

    afd = {"port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1}
    colo = Server(
        ServerSpec(
            "colocated",
            model_dir,
            free_port(),
            extra_args=common,
            env={**bind("0-1"), "OMP_NUM_THREADS": "2" if two_cores else "1", **dev},
        ),
        log_dir,
    )
    ffn = Server(
        ServerSpec(
            "ffn",
            model_dir,
            free_port(),
            afd={**afd, "role": "ffn"},
            extra_args=common,
            env={**bind("1"), "AFD_STEP_TRACE": trace, **one},
        ),
        log_dir,
    )
    att = Server(
        ServerSpec(
            "attention",
            model_dir,
            free_port(),
            afd={**afd, "role": "attention"},
            extra_args=common
            + ["--enable-dbo", "--dbo-decode-token-threshold", "2"]
            + ["--dbo-prefill-token-threshold", "2"],
            env={**bind("0"), "AFD_STEP_TRACE": trace, **dev, **one},
        ),
        log_dir,
    )
    return [colo, ffn, att], colo.url, att.url, trace


def measure(
    colocated_url: str,
    attention_url: str,
    trace: str,
    batches: list[int],
    tokens: int,
    reps: int,
    progress: Callable[[str], None],
) -> dict:
    """Colocated vs AFD m=1 vs AFD m=2 at each batch size, `reps` times each, plus the batch-1
    AFD m=1 point the host's fixed costs are taken from, on running servers: the attention
    server DBO-capable with vLLM's dev endpoints (VLLM_SERVER_DEV_MODE=1), both AFD servers
    writing step timelines to `trace` (AFD_STEP_TRACE). Returns raw samples (seconds)."""
    from afd_plugin.deploy.servers import collective_rpc

    urls = {"colocated": colocated_url, "AFD m=1": attention_url, "AFD m=2": attention_url}
    samples: dict = {"runs": {}, "calibration": {}}
    progress("warm-up")
    for url in (colocated_url, attention_url):
        _batch_run(url, 2, 4)
    collective_rpc(attention_url, "afd_set_microbatching", "1")
    cal = Window()
    for rep in range(reps):
        progress(f"fixed costs: AFD m=1 batch 1, rep {rep + 1}/{reps}")
        _batch_run(attention_url, 1, SHORT)
        _, start, end = _batch_run(attention_url, 1, SHORT + tokens)
        w = read_window(trace, start, end)
        for name in ("steps", "busy", "intervals", "ffn_compute"):
            getattr(cal, name).extend(getattr(w, name))
    if not (cal.steps and cal.ffn_compute):
        raise RuntimeError(
            f"no decode steps in the timelines {trace}.attention0.jsonl / .ffn0.jsonl: do "
            "both AFD servers run with AFD_STEP_TRACE set to that prefix?"
        )
    samples["calibration"] = cal.__dict__
    for b in batches:
        for rep in range(reps):
            for name, m in CONFIGS:
                progress(f"batch {b}, rep {rep + 1}/{reps}: {name}")
                if m is not None:
                    collective_rpc(attention_url, "afd_set_microbatching", str(m))
                t_short, _, _ = _batch_run(urls[name], b, SHORT)
                t_long, start, end = _batch_run(urls[name], b, SHORT + tokens)
                run = samples["runs"].setdefault(
                    f"{b}|{name}", {"tpot": [], "step": [], "interval": []}
                )
                run["tpot"].append((t_long - t_short) / tokens)
                if m is not None:
                    w = read_window(trace, start, end)
                    run["step"].append(_median(w.steps))
                    run["interval"].append(_median(w.intervals))
    collective_rpc(attention_url, "afd_set_microbatching", "1")
    return samples
