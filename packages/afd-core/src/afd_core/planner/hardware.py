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

from afd_core.capabilities import PLATFORMS as CAPABILITIES
from afd_core.planner.errors import PlanInputError

PROFILE_FORMAT = 1
PLATFORMS = tuple(CAPABILITIES)


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
    # the platform AFD runs on there: what AFD runs there (afd_core.capabilities)
    platform: str = "cuda"
    # a two-level network: `scale_up_domain` devices share the link above (NVLink, UB);
    # traffic between domains takes the scale-out link (a NIC per device). 0: one domain
    scale_up_domain: int = 0
    scale_out_latency_us: float = 0.0
    scale_out_bandwidth_gbps: float = 0.0  # GB/s per direction per device
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
        if self.platform not in PLATFORMS:
            raise PlanInputError(
                f"hardware {self.name}: platform={self.platform!r}; allowed: {', '.join(PLATFORMS)}"
            )
        if isinstance(self.scale_up_domain, bool) or not isinstance(self.scale_up_domain, int):
            raise PlanInputError(
                f"hardware {self.name}: scale_up_domain={self.scale_up_domain!r} must be an integer"
            )
        if self.scale_up_domain < 0 or (
            self.scale_up_domain and not self.scale_out_bandwidth_gbps > 0
        ):
            raise PlanInputError(
                f"hardware {self.name}: scale_up_domain={self.scale_up_domain} with "
                f"scale_out_bandwidth_gbps={self.scale_out_bandwidth_gbps}; allowed: 0 (one "
                "domain), or devices per domain >= 1 with a scale-out bandwidth > 0"
            )
        for name in (
            "scale_out_latency_us",
            "scale_out_bandwidth_gbps",
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

    def remote_fraction(self, devices: int) -> float:
        """The share of a device's peers outside its scale-up domain when `devices` are
        packed into domains (each domain holding both roles in proportion)."""
        if not self.scale_up_domain or devices <= self.scale_up_domain:
            return 0.0
        return 1.0 - self.scale_up_domain / devices

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_gib * 2**30 * self.usable_memory_fraction

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, **asdict(self)}


# Datasheet peaks (dense BF16, HBM, scale-up link per direction); alpha 20 us is the
# NCCL/XCCL-class point-to-point latency (docs/planner.md cites where each comes from).
# The efficiency fractions are calibrated: 0.7 x the usual assumption (0.8 of HBM, 0.6 of
# the matmul peak) makes the colocated predictions of DeepSeek-V3 on Hopper (Step-3
# report: 2,324 tok/s/GPU) and on 910C (CloudMatrix-Infer: 1,943 tok/s/NPU) fit within 2%
# (benchmarks/planner_vs_published.py --fit; the held-out rows: docs/planner.md).
# Scale-out: one 400 Gb/s NIC per device (50 GB/s per direction: ConnectX-7 in HGX H100/
# H200/B200 and GB200 NVL72 systems; RoCE on Ascend supernodes), alpha 25 us (assumed).
_GPU = dict(memory_efficiency=0.56, matmul_efficiency=0.42, step_overhead_us=1000.0)
_NIC = dict(scale_out_latency_us=25.0, scale_out_bandwidth_gbps=50.0)
PRESETS: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        "h100", 80, 3350, 989, 20, 450, **_GPU, scale_up_domain=8, **_NIC,
        source="H100 SXM datasheet, NVLink4 within an 8-GPU HGX node, a 400G NIC per GPU",
    ),
    "h200": HardwareProfile(
        "h200", 141, 4800, 989, 20, 450, **_GPU, scale_up_domain=8, **_NIC,
        source="H200 SXM datasheet, NVLink4 within an 8-GPU HGX node, a 400G NIC per GPU",
    ),
    "b200": HardwareProfile(
        "b200", 180, 8000, 2250, 20, 900, **_GPU, scale_up_domain=8, **_NIC,
        source="B200 datasheet, NVLink5 within an 8-GPU HGX node, a 400G NIC per GPU",
    ),
    "gb200-nvl72": HardwareProfile(
        "gb200-nvl72", 186, 8000, 2500, 20, 900, **_GPU, scale_up_domain=72, **_NIC,
        source="GB200 NVL72 datasheet, per GPU: one NVLink5 domain of 72, a 400G NIC per GPU",
    ),
    "ascend-910c": HardwareProfile(
        "ascend-910c", 128, 3200, 752, 20, 392, **_GPU, platform="npu", scale_up_domain=384,
        **_NIC,
        source="Ascend 910C per chip; UB link of a CloudMatrix384 supernode (arXiv 2506.12708)",
    ),
}  # fmt: skip


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
