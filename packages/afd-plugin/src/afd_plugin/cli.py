"""The `afd` command line: `afd doctor`, `afd demo`."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afd", description="Attention-FFN Disaggregation for vLLM"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check whether AFD can run here, and why not")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    from afd_plugin.demo import add_arguments

    demo = sub.add_parser("demo", help="run an AFD deployment on this machine (CPU)")
    add_arguments(demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from afd_plugin.doctor import main as doctor_main

        return doctor_main(args)
    if args.command == "demo":
        from afd_plugin.demo import main as demo_main

        return demo_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
