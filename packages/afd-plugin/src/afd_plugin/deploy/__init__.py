"""Deploying AFD servers: one spec (`spec`), checked as the servers check it, and the
ways it runs.

- `spec`: the deployment spec (TOML), its checks, and the `vllm serve` command of every
  server on every host;
- `from_plan`: the spec `afd plan --write-spec` writes;
- `launch`: `afd launch` (bare hosts), `ray_launch`: `afd ray`, `k8s`: `afd k8s`;
- `servers`: starting, watching and stopping local server processes (the demo, `afd
  bench`, tests and `afd launch` share it).

Imports run one way: `spec` → `from_plan`, `launch` → `ray_launch`; `servers` imports
nothing of these.
"""
