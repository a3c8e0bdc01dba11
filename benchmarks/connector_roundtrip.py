"""Connector round trip vs raw gloo send/recv of the same tensors, in the same run.

The sweep of `afd bench` alone (afd_plugin.bench.connector): two local processes, the AFD
connector's per-layer exchange interleaved iteration by iteration with raw gloo send/recv
of the same bf16 tensors. Prints medians, spread and the ratio per size, the link fit
(latency, bandwidth) and the time of a whole one-layer step with its control message.

    uv run --no-sync python benchmarks/connector_roundtrip.py [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics

from afd_plugin.bench import connector, report

HIDDENS = [2048, 7168]
ROWS = [1, 4, 16, 64, 256]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    points, steps = connector.run_sweep(HIDDENS, ROWS, a.iters)
    latency, bandwidth = connector.fit_link(points)
    rows = report.sweep_rows(points)
    print(report.render({"connector_sweep": rows, "link_fit": {
        "latency_us": latency * 1e6, "bandwidth_gbps": bandwidth / 1e9},
        "compute": {"matmul_gflops": float("nan"), "memory_gbps": float("nan")}}).split("\ncompute")[0])  # fmt: skip
    for hidden, times in steps.items():
        print(
            f"  hidden {hidden}: one-layer step with its control message and status: median "
            f"{statistics.median(times) * 1e6:.1f} us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
