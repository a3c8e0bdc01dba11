"""`afd doctor`: can AFD run here, and if not, why.

Runs register_afd in this process (as vLLM would), then imports the vLLM modules its
deferred steps wait for, so a deferred registration that fails shows as failed; reports
versions, platform, every registration step and patch, the AFD models and the connectors,
and on CPU which vLLM kernel library this CPU gets and which models need ops it lacks
(afd_models.cpu_ops). Exit status 0 only when an AFD deployment can start on this machine.
"""

from __future__ import annotations

import platform
import sys
import time
from importlib import metadata


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def resolve_deferred_steps() -> list[str]:
    """Import every module a deferred step waits for, as a vLLM server would; the steps
    record their real outcome. Returns the imports that failed."""
    import importlib

    from afd_core.patches.import_hooks import pending

    problems = []
    for module in pending():
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"importing {module} failed: {type(exc).__name__}: {exc}")
    return problems


def _ascend_patch_info():
    """afd-npu's Ascend config patch (applied only on an NPU platform), or None."""
    try:
        from afd_npu.patches.ascend_config import INFO
    except ImportError:
        return None
    return INFO


def collect(progress=lambda what: None) -> dict:
    """Everything the report shows, as data (tests read this); `progress(what)` before each
    slow stage (importing vLLM and registering AFD take about a minute on a small CPU)."""
    from afd_core import registration as reg
    from afd_core.connectors.registry import _SPECS
    from afd_core.patches import CORE_PATCHES
    from afd_core.patches.catalogue import info
    from afd_core.version_gate import SUPPORTED_VLLM_VERSION, installed_vllm, is_supported

    problems: list[str] = []
    progress("looking for vLLM")
    vllm = installed_vllm()
    report: dict = {
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "vllm": None if vllm is None else vllm.version,
        "vllm_distribution": None if vllm is None else vllm.distribution,
        "supported_vllm": SUPPORTED_VLLM_VERSION,
        "vllm_supported": vllm is not None and is_supported(vllm.version),
        "platform": None,
        "afd_packages": {
            d: _dist_version(d) for d in ("afd-core", "afd-models", "afd-npu", "afd-plugin")
        },
    }
    if vllm is None:
        problems.append("vLLM is not installed: install afd-plugin[cpu], [cuda] or [npu]")
    elif not report["vllm_supported"]:
        problems.append(f"vLLM {vllm.version} is installed; AFD supports {SUPPORTED_VLLM_VERSION}")

    models: list[str] = []
    if vllm is not None:
        progress(f"importing vLLM {vllm.version} ({vllm.distribution})")
        try:
            from vllm.platforms import current_platform

            report["platform"] = current_platform.device_type
        except Exception as exc:
            problems.append(f"vLLM's platform could not be detected: {exc}")
        from afd_plugin import register_afd

        progress("registering AFD (its patches and models)")
        try:
            register_afd()
        except Exception as exc:
            problems.append(f"register_afd raised {type(exc).__name__}: {exc}")
        problems += resolve_deferred_steps()
        try:
            from vllm.model_executor.models import ModelRegistry

            models = sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith("AFD"))
        except Exception as exc:
            problems.append(f"the model registry could not be read: {exc}")

    steps = reg.records()
    report["steps"] = {n: {"status": r.status.value, "reason": r.reason} for n, r in steps.items()}
    report["patches"] = {}
    for name in CORE_PATCHES:
        rec = steps.get(reg.patch_step(name))
        meta = info(name)
        report["patches"][name] = {
            "status": rec.status.value if rec else "not run",
            "reason": rec.reason if rec else "",
            "why": meta.why,
            "replaces": list(meta.replaces),
        }
    ascend = _ascend_patch_info()
    if ascend is not None:  # afd-npu installed: its patch is listed wherever doctor runs
        rec = steps.get(reg.STEP_ASCEND_CONFIG)
        report["patches"][ascend.name] = {
            "status": rec.status.value if rec else "not run",
            "reason": rec.reason if rec else "",
            "why": ascend.why,
            "replaces": list(ascend.replaces),
        }
    report["models"] = models
    device = report["platform"]
    report["connectors"] = {
        s.name: {"platforms": list(s.device_types), "usable_here": device in s.device_types}
        for s in _SPECS.values()
    }
    if vllm is not None:
        for name in reg.ALWAYS_NEEDED:
            rec = steps.get(name)
            if rec is None:
                problems.append(f"step {name} did not run")
            elif not rec.ok:
                problems.append(f"step {name}: {rec.status.value}: {rec.reason}")
        if device is not None and not any(c["usable_here"] for c in report["connectors"].values()):
            problems.append(f"no connector is available for platform {device!r}")
    report["cpu_kernels"] = None
    if device == "cpu":  # not a problem: a model lacking ops is listed, the others can run
        from afd_models import cpu_ops

        progress("loading vLLM's CPU kernels")
        try:
            report["cpu_kernels"] = cpu_ops.report(cpu_ops.load_vllm_kernels())
        except Exception as exc:
            problems.append(f"vLLM's CPU kernels could not be loaded: {type(exc).__name__}: {exc}")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def render_cpu_kernels(kernels: dict) -> list[str]:
    """Which models need ops only some vLLM CPU builds have, and whether this one has them."""
    lines = ["", f"vLLM CPU kernels: {kernels['library']} ({kernels['instruction_set']})"]
    for arch, roles in kernels["models"].items():
        counts = ", ".join(f"{role} {len(r['needs'])}" for role, r in roles.items())
        total = sum(len(r["needs"]) for r in roles.values())
        lacking = [
            f"{role} lacks {', '.join(r['missing'])}" for role, r in roles.items() if r["missing"]
        ]
        verdict = f"cannot run here: {'; '.join(lacking)}" if lacking else "all here"
        lines.append(
            f"  {arch:38s} needs {total} ops only {kernels['only_in']} has ({counts}): {verdict}"
        )
    lines.append("  (the other AFD models need no op that only some vLLM CPU builds have)")
    return lines


def render(report: dict) -> str:
    lines = ["AFD doctor", ""]
    lines.append(f"  python              {report['python']}")
    lines.append(f"  torch               {report['torch'] or 'not installed'}")
    vllm = report["vllm"]
    dist = f" (distribution {report['vllm_distribution']})" if vllm else ""
    lines.append(f"  vllm                {vllm or 'not installed'}{dist}")
    sup = "yes" if report["vllm_supported"] else "NO"
    lines.append(f"  supported vllm      {report['supported_vllm']} -> {sup}")
    lines.append(f"  platform            {report['platform'] or 'unknown'}")
    pk = ", ".join(f"{k} {v or '-'}" for k, v in report["afd_packages"].items())
    lines.append(f"  afd packages        {pk}")
    lines += ["", "Registration steps:"]
    for name, step in report["steps"].items():
        status, reason = step["status"], step["reason"]
        lines.append(f"  {name:38s} {status}" + (f"  ({reason})" if reason else ""))
    lines += ["", "Patches:"]
    for name, p in report["patches"].items():
        extra = f"  ({p['reason']})" if p["reason"] else ""
        lines.append(f"  {name:38s} {p['status']}{extra}")
        lines.append(f"      replaces: {', '.join(p['replaces'])}")
    lines += ["", "AFD models:"]
    lines += [f"  {m}" for m in report["models"]] or ["  (none registered)"]
    lines += ["", "Connectors:"]
    for name, c in report["connectors"].items():
        here = "usable here" if c["usable_here"] else "not for this platform"
        lines.append(f"  {name:12s} platforms: {', '.join(c['platforms'])}  ({here})")
    if report.get("cpu_kernels"):
        lines += render_cpu_kernels(report["cpu_kernels"])
    lines.append("")
    if report["ok"]:
        lines.append("AFD can run here.")
    else:
        lines.append("AFD cannot run here:")
        lines += [f"  - {p}" for p in report["problems"]]
    return "\n".join(lines)


def main(args=None) -> int:
    t0 = time.monotonic()

    def progress(what: str) -> None:  # on stderr: --json's stdout stays one document
        print(f"afd doctor: {what} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    report = collect(progress)
    if getattr(args, "json", False):
        import json

        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
