"""A device's rates, as the planner needs them: presets, JSON/TOML files, `afd bench`.

Units in files and presets are the ones datasheets use: GiB of memory, GB/s, TFLOP/s, us.
Datasheet presets are peak numbers scaled by an achievable fraction (`memory_efficiency`,
`matmul_efficiency`); a profile `afd bench` measured holds achieved rates (fractions 1.0)
and this host's fixed costs per layer, which eager execution on a CPU is dominated by.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from afd_core.planner.errors import PlanInputError

PROFILE_FORMAT = 1


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    memory_gib: float  # device memory for weights and KV cache
    memory_bandwidth_gbps: float  # GB/s
    matmul_tflops: float  # dense, at the model's weight dtype
    link_latency_us: float  # alpha of one transfer between an attention and an FFN device
    link_bandwidth_gbps: float  # GB/s per direction per device
    memory_efficiency: float = 1.0  # achievable fraction of memory_bandwidth_gbps
    matmul_efficiency: float = 1.0  # achievable fraction of matmul_tflops
    # fixed time of one layer's work on one side for one micro-batch (kernel launches,
    # Python in eager mode); ~0 under CUDA graphs
    attention_layer_overhead_us: float = 0.0
    ffn_layer_overhead_us: float = 0.0
    # fixed time of one step outside the layers (embedding, LM head launch, sampling prep)
    step_overhead_us: float = 0.0
    usable_memory_fraction: float = 0.9  # of memory_gib, for weights + KV cache
    # how much of a layer's weight reading hides behind its arithmetic: 1 = the roofline
    # max(memory, compute) (a GPU's many warps); 0 = their sum (one CPU thread)
    compute_memory_overlap: float = 1.0
    source: str = ""  # where the numbers come from

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("float", float) and not isinstance(v, int | float):
                raise PlanInputError(f"hardware {self.name}: {f.name}={v!r} must be a number")
        positive = (
            "memory_gib",
            "memory_bandwidth_gbps",
            "matmul_tflops",
            "link_bandwidth_gbps",
            "memory_efficiency",
            "matmul_efficiency",
            "usable_memory_fraction",
        )
        for name in positive:
            v = getattr(self, name)
            if not v > 0:
                raise PlanInputError(f"hardware {self.name}: {name}={v} must be > 0")
        if not 0 <= self.compute_memory_overlap <= 1:
            raise PlanInputError(
                f"hardware {self.name}: compute_memory_overlap={self.compute_memory_overlap} "
                "must be in [0, 1]"
            )
        for name in ("memory_efficiency", "matmul_efficiency", "usable_memory_fraction"):
            if getattr(self, name) > 1:
                raise PlanInputError(
                    f"hardware {self.name}: {name}={getattr(self, name)} must be in (0, 1]"
                )
        for name in (
            "link_latency_us",
            "attention_layer_overhead_us",
            "ffn_layer_overhead_us",
            "step_overhead_us",
        ):
            v = getattr(self, name)
            if not v >= 0:
                raise PlanInputError(f"hardware {self.name}: {name}={v} must be >= 0")

    # rates in SI units, achievable
    @property
    def bytes_per_s(self) -> float:
        return self.memory_bandwidth_gbps * 1e9 * self.memory_efficiency

    @property
    def flops_per_s(self) -> float:
        return self.matmul_tflops * 1e12 * self.matmul_efficiency

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_bandwidth_gbps * 1e9

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_gib * 2**30 * self.usable_memory_fraction

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, **asdict(self)}


# Datasheet peaks (dense BF16, HBM, scale-up link per direction); alpha 20 us is the
# NCCL/XCCL-class point-to-point latency (docs/planner.md cites where each comes from).
# The efficiency fractions are assumptions (what tuned kernels reach), not measurements.
_GPU = dict(memory_efficiency=0.8, matmul_efficiency=0.6, step_overhead_us=1000.0)
PRESETS: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        "h100", 80, 3350, 989, 20, 450, **_GPU, source="H100 SXM datasheet, NVLink4"
    ),
    "h200": HardwareProfile(
        "h200", 141, 4800, 989, 20, 450, **_GPU, source="H200 SXM datasheet, NVLink4"
    ),
    "b200": HardwareProfile(
        "b200", 180, 8000, 2250, 20, 900, **_GPU, source="B200 datasheet, NVLink5"
    ),
    "gb200-nvl72": HardwareProfile(
        "gb200-nvl72",
        186,
        8000,
        2500,
        20,
        900,
        **_GPU,
        source="GB200 NVL72 datasheet, per GPU, one NVLink5 domain",
    ),
    "ascend-910c": HardwareProfile(
        "ascend-910c",
        128,
        3200,
        752,
        20,
        392,
        **_GPU,
        source="Ascend 910C per chip; UB link of CloudMatrix384 (arXiv 2506.12708)",
    ),
}


def _from_mapping(data: dict, source: str) -> HardwareProfile:
    if not isinstance(data, dict):
        raise PlanInputError(f"hardware profile {source}: expected a table/object")
    data = dict(data)
    fmt = data.pop("format", PROFILE_FORMAT)
    if fmt != PROFILE_FORMAT:
        raise PlanInputError(
            f"hardware profile {source}: format={fmt!r} is not supported (allowed: "
            f"{PROFILE_FORMAT})"
        )
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanInputError(
            f"hardware profile {source}: unknown field(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(known))}"
        )
    required = [
        "memory_gib",
        "memory_bandwidth_gbps",
        "matmul_tflops",
        "link_latency_us",
        "link_bandwidth_gbps",
    ]
    missing = [k for k in required if k not in data]
    if missing:
        raise PlanInputError(
            f"hardware profile {source}: field(s) {', '.join(missing)} missing "
            f"(required: {', '.join(required)})"
        )
    data.setdefault("name", Path(source).stem)
    data.setdefault("source", source)
    return HardwareProfile(**data)


def load_hardware(spec: str) -> HardwareProfile:
    """A preset name, or a .json / .toml file (the fields of HardwareProfile)."""
    key = spec.lower()
    if key in PRESETS:
        return PRESETS[key]
    if key == "cpu":
        return load_hardware(str(Path(__file__).with_name("cpu_profile.json")))
    path = Path(spec)
    if not path.is_file():
        raise PlanInputError(
            f"hardware {spec!r} is neither a preset ({', '.join([*sorted(PRESETS), 'cpu'])}) "
            "nor a .json/.toml profile file"
        )
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PlanInputError(f"hardware profile {path}: cannot be parsed ({exc})") from exc
    return _from_mapping(data, str(path))


def save_hardware(profile: HardwareProfile, path: Path) -> None:
    path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
