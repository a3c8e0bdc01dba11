"""The AFD planner: which attention:FFN shape, micro-batch count and batch size a model
needs on given hardware to meet a time-per-output-token target, and whether AFD pays
against colocated expert parallelism. Pure Python (no torch, no vLLM): `afd plan` and
`afd bench` use it, and it runs anywhere.

- `model_shape`: the model's sizes (from an HF config.json or a preset)
- `hardware`: the device's rates (presets, JSON/TOML files, or what `afd bench` measured)
- `costs`: per-layer attention, FFN and transfer times (roofline + fixed costs)
- `pipeline`: the micro-batch ping-pong schedule of one step
- `search`: candidate shapes, the colocated estimate, the verdict
"""

from afd_core.planner.errors import PlanInputError

__all__ = ["PlanInputError"]
