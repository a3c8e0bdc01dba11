"""`afd plan`: the best A:F shapes for a model on a hardware profile at a TPOT target.

Exit status: 0 a plan was printed; 2 a bad input (named in the message); 3 the target
cannot be met by any shape, AFD or colocated (said plainly, never relaxed).
"""

from __future__ import annotations

import argparse
import json
import sys

from afd_core.planner.hardware import PRESETS as HARDWARE_PRESETS
from afd_core.planner.model_shape import PRESETS as MODEL_PRESETS

EXIT_SLO_UNMET = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(sorted(MODEL_PRESETS))}), an HF config.json, or a "
        "checkpoint folder",
    )
    p.add_argument(
        "--hardware",
        required=True,
        help=f"a preset ({', '.join([*sorted(HARDWARE_PRESETS), 'cpu'])}) or a .json/.toml "
        "profile (e.g. written by `afd bench --save-profile`)",
    )
    p.add_argument(
        "--tpot-ms", type=float, required=True, help="time per output token target, in milliseconds"
    )
    p.add_argument("--context", type=int, required=True, help="context length in tokens")
    p.add_argument("--max-devices", type=int, default=128, help="devices available")
    p.add_argument("--top", type=int, default=8, help="shapes to list")
    p.add_argument(
        "--weight-bytes",
        type=float,
        help="bytes per weight, the experts' included (instead of the config's dtype and "
        "quantization_config)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--write-spec",
        metavar="FILE",
        help="write the best shape as a deployment spec for `afd launch` (needs --host)",
    )
    p.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME=ADDRESS:DEVICES",
        help="a host for --write-spec (repeat; filled in order, FFN ranks first)",
    )
    p.add_argument(
        "--platform",
        choices=("cpu", "cuda", "npu"),
        help="the spec's platform (default: the hardware profile's `platform`, which the plan used)",
    )


def main(args: argparse.Namespace) -> int:
    from afd_core.planner.errors import PlanInputError
    from afd_core.planner.hardware import load_hardware
    from afd_core.planner.model_shape import load_model
    from afd_core.planner.search import plan

    try:
        if args.weight_bytes is not None and not args.weight_bytes > 0:
            raise PlanInputError(f"--weight-bytes={args.weight_bytes} is invalid; allowed: > 0")
        model = load_model(args.model, args.weight_bytes)
        hw = load_hardware(args.hardware)
        for flag, value, ok, allowed in (
            ("--tpot-ms", args.tpot_ms, args.tpot_ms > 0, "> 0 (milliseconds)"),
            ("--context", args.context, args.context > 0, ">= 1 (tokens)"),
            ("--max-devices", args.max_devices, args.max_devices >= 2, ">= 2"),
            ("--top", args.top, args.top >= 1, ">= 1"),
        ):
            if not ok:  # named by the flag, before the planner names its parameter
                raise PlanInputError(f"{flag}={value} is invalid; allowed: {allowed}")
        result = plan(model, hw, args.tpot_ms, args.context, args.max_devices, args.top)
    except PlanInputError as exc:
        print(f"afd plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(render(result, hw))
    if args.write_spec:
        written = _write_spec(args, result, hw.platform)
        if written != 0:
            return written
    return 0 if result.slo_met else EXIT_SLO_UNMET


def _write_spec(args: argparse.Namespace, result, profile_platform: str) -> int:
    from pathlib import Path

    from afd_plugin.deploy.from_plan import write_spec
    from afd_plugin.deploy.spec import SpecError

    if not result.candidates:
        print("afd plan: no AFD shape meets the target: no spec written", file=sys.stderr)
        return EXIT_SLO_UNMET
    platform = args.platform or profile_platform  # the platform the plan was made for
    try:
        shape = write_spec(
            result.candidates, args.model, args.host, platform, Path(args.write_spec)
        )
    except SpecError as exc:
        print(f"afd plan: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"afd plan: cannot write {args.write_spec}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"\nwrote {args.write_spec} with {shape}: afd launch {args.write_spec} --print")
    return 0


def render(result, hw) -> str:
    lines = [
        f"{result.model} ({result.weights_gb:,.1f} GB of weights) on {result.hardware} "
        f"({hw.source or 'custom profile'}), TPOT <= {result.tpot_target_ms:g} ms, "
        f"context {result.context}",
        "",
        "AFD: A attention devices : F FFN devices, m micro-batches, B requests per attention "
        "device (capped by: the TPOT target or memory); attn, ffn and xfer: microseconds per "
        "layer and micro-batch",
    ]
    if result.candidates:
        lines.append(
            f"  {'shape':>8} {'devices':>7} {'m':>2} {'B':>6} {'cap':>6} {'TPOT ms':>8} "
            f"{'tok/s/dev':>10} {'tok/s total':>12} {'attn us':>8} {'ffn us':>8} "
            f"{'xfer us':>8}  bound"
        )
        for c in result.candidates:
            b = c.breakdown
            lines.append(
                f"  {c.shape:>8} {c.devices:>7} {c.microbatches:>2} "
                f"{c.batch_per_attention_device:>6} {c.capped_by:>6} {c.tpot_ms:>8.1f} "
                f"{c.tokens_per_s_per_device:>10.1f} {c.tokens_per_s_per_device * c.devices:>12,.0f} "
                f"{b.attention_layer_s * 1e6:>8.1f} {b.ffn_layer_s * 1e6:>8.1f} "
                f"{b.transfer_s * 1e6:>8.1f}  {b.bound}"
            )
    else:
        lines.append("  no shape AFD can serve meets the target")
    lines += ["", "colocated expert parallel: N devices, B requests per device"]
    if result.colocated:
        lines.append(
            f"  {'N':>8} {'m':>2} {'B':>6} {'cap':>6} {'TPOT ms':>8} {'tok/s/dev':>10} "
            f"{'tok/s total':>12}"
        )
        for c in result.colocated:
            lines.append(
                f"  {c.devices:>8} {c.microbatches:>2} {c.batch_per_device:>6} {c.capped_by:>6} "
                f"{c.tpot_ms:>8.1f} {c.tokens_per_s_per_device:>10.1f} "
                f"{c.tokens_per_s_per_device * c.devices:>12,.0f}"
            )
    else:
        lines.append("  no colocated deployment meets the target")
    lines += ["", result.verdict()]
    return "\n".join(lines)
