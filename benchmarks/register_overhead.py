"""Time register_afd adds to a process that has already imported vLLM.

vLLM calls the plugin in every process it starts (API server, engine core, each worker,
model inspection), so this cost is paid many times per deployment. Each sample is a fresh
interpreter that imports vLLM and its model registry, then times vLLM's own
load_general_plugins() with VLLM_PLUGINS naming only the AFD plugin, against the same
call with no plugin selected (the baseline), in the same process type. Goal: < 100 ms.

    uv run --no-sync python benchmarks/register_overhead.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = r"""
import json, time
import vllm  # noqa: F401
from vllm.model_executor.models import ModelRegistry  # noqa: F401 - as every process has
from vllm.plugins import load_general_plugins
t0 = time.perf_counter()
load_general_plugins()
t1 = time.perf_counter()
import afd_plugin
print(json.dumps({"ms": (t1 - t0) * 1e3, "registered": afd_plugin._registered}))
"""


def sample(plugins: str) -> dict:
    env = {**os.environ, "VLLM_PLUGINS": plugins}
    r = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    with_afd, without = [], []
    for _ in range(a.runs):  # alternate, so drift hits both alike
        s = sample("afd")
        assert s["registered"], "register_afd did not run"
        with_afd.append(s["ms"])
        s = sample("none-selected")
        assert not s["registered"]
        without.append(s["ms"])
    m_with, m_without = statistics.median(with_afd), statistics.median(without)
    print(f"load_general_plugins() after `import vllm`, median of {a.runs} fresh processes")
    print(f"  without the AFD plugin : {m_without:8.1f} ms")
    print(f"  with the AFD plugin    : {m_with:8.1f} ms")
    print(
        f"  added by register_afd  : {m_with - m_without:8.1f} ms  (goal < 100 ms; "
        f"ratio {m_with / max(m_without, 1e-3):.1f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
