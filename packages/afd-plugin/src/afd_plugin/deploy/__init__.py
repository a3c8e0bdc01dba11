"""Deploying AFD servers: one spec (`spec`), checked as the servers check it, and the
ways it runs.

- `spec`: the deployment spec (TOML), its checks, and the `vllm serve` command of every
  server on every host; `server_check`: each server checked as it will check itself at
  start-up; `devices`: which devices each server part of a shared host runs on;
- `from_plan`: the spec `afd plan --write-spec` writes;
- `launch`: `afd launch` (bare hosts; `firewall`: the rules it prints), `ray_launch`: `afd
  ray`, `k8s`: `afd k8s`;
- `servers`: starting, watching and stopping local server processes (the demo, `afd
  bench`, tests and `afd launch` share it).

Imports run one way: `server_check`, `devices` → `spec` → `from_plan`, `firewall`,
`launch` → `ray_launch`; `servers` imports nothing of these.
"""
