"""The AFD config schema: `--additional-config '{"afd": {...}}'`.

AFD is active iff the `afd` key is present. Every bad input raises AFDConfigError (a
ValueError) naming the field, the value and what is allowed, before any process group or
socket exists. Coercion rules (also in docs/configuration.md):

* booleans: JSON true/false, the integers 0/1, or the strings true/false, 1/0, yes/no,
  on/off (any case); anything else is an error;
* integers: JSON integers or strings of decimal digits ("8"); booleans and floats (even
  2.0) are errors;
* strings: JSON strings only.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from afd_core.connectors.protocol.control import MAX_MICROBATCHES
from afd_core.connectors.registry import available_connectors, connector_spec
from afd_core.errors import AFDConfigError

__all__ = ["AFDConfig", "AFDConfigError", "parse_afd_config", "parse_optional_afd_config"]

ROLES = ("attention", "ffn")
AFD_KEY = "afd"

AUTO = "auto"  # num_microbatches chosen per step (afd_core.step.tuner)

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce_bool(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError("expected a boolean: true/false, 0/1, or 'yes'/'no'/'on'/'off'")


def _coerce_int(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise ValueError("expected an integer (JSON number without fraction or digit string)")
    if isinstance(v, str):
        s = v.strip()
        if not s.lstrip("+-").isdigit():
            raise ValueError("expected an integer (JSON number without fraction or digit string)")
        return int(s)
    return v


def _require_str(v: Any) -> Any:
    if not isinstance(v, str):
        raise ValueError("expected a string")
    return v


def coerce_microbatches(v: Any) -> Any:
    """num_microbatches as the config and the run-time RPC read it: 1..4, or "auto" in any
    case; ValueError otherwise."""
    if v is None:
        return None
    if isinstance(v, str) and v.strip().lower() == AUTO:
        return AUTO
    try:
        n = _coerce_int(v)
    except ValueError:
        n = None
    if n is None or not 1 <= n <= MAX_MICROBATCHES:
        raise ValueError(f"expected an integer 1..{MAX_MICROBATCHES} or {AUTO!r}")
    return n


Bool = Annotated[bool, BeforeValidator(_coerce_bool)]
Int = Annotated[int, BeforeValidator(_coerce_int)]
Str = Annotated[str, BeforeValidator(_require_str)]
Microbatches = Annotated[int | Literal["auto"] | None, BeforeValidator(coerce_microbatches)]


class AFDConfig(BaseModel):
    """One side's view of an AFD deployment."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    role: Literal["attention", "ffn"]
    connector: Str = Field(min_length=1)
    host: Str = Field(default="127.0.0.1", min_length=1)
    port: Int = Field(default=29650, ge=1, le=65535)
    num_attention_ranks: Int = Field(default=1, ge=1)
    num_ffn_ranks: Int = Field(default=1, ge=1)
    # the rank, in its role, of this server's first worker: a deployment may be several
    # attention and several FFN servers (like vLLM's --data-parallel-start-rank)
    start_rank: Int = Field(default=0, ge=0)
    compute_gate_on_attention: Bool = False
    async_dp: Bool = False
    # micro-batches per step on an attention server (DBO); None: from vLLM's --enable-dbo
    # (2) / --ubatch-size, else 1; "auto": chosen per step in 1..4 from measured steps.
    # Resolved and checked at start-up (patches/config_validation)
    num_microbatches: Microbatches = None
    connector_extra_config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("connector")
    @classmethod
    def _known_connector(cls, v: str) -> str:
        names = available_connectors()
        if v not in names:
            close = difflib.get_close_matches(v, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown connector{hint}")
        return v

    @property
    def is_attention(self) -> bool:
        return self.role == "attention"

    @property
    def is_ffn(self) -> bool:
        return self.role == "ffn"

    @property
    def adaptive_microbatches(self) -> bool:
        """m is chosen per step (num_microbatches "auto")."""
        return self.num_microbatches == AUTO

    @property
    def max_microbatches(self) -> int:
        """The most micro-batches a step of this server may have."""
        if self.adaptive_microbatches:
            return MAX_MICROBATCHES
        return self.num_microbatches or 1

    def extra(self) -> BaseModel:
        """The connector's own, validated extra config."""
        return connector_spec(self.connector).parse_extra(self.connector_extra_config)

    def compute_hash(self) -> str:
        """Stable hash of the fields that change what vLLM builds and compiles on this side."""
        factors = {
            "role": self.role,
            "connector": self.connector,
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "compute_gate_on_attention": self.compute_gate_on_attention,
            "async_dp": self.async_dp,
            "num_microbatches": self.num_microbatches,
        }
        blob = json.dumps(factors, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


_FIELD_HELP = {
    "role": "'attention' or 'ffn'",
    "connector": "one of " + ", ".join(repr(c) for c in available_connectors()),
    "host": "a non-empty host name or IP address of FFN rank 0",
    "port": "an integer 1..65535",
    "num_attention_ranks": "an integer >= 1",
    "num_ffn_ranks": "an integer >= 1",
    "start_rank": "an integer >= 0, below the number of ranks of this server's role",
    "compute_gate_on_attention": "a boolean",
    "async_dp": "a boolean",
    "num_microbatches": "an integer 1..4, or 'auto' to choose per step (attention servers; "
    "DBO micro-batches per step)",
    "connector_extra_config": "a JSON object (checked by the connector's own schema)",
}


def _format_error(err: dict[str, Any], raw: Mapping[str, Any]) -> AFDConfigError:
    loc = ".".join(str(p) for p in err["loc"])
    field = str(err["loc"][0]) if err["loc"] else ""
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(field, AFDConfig.model_fields, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return AFDConfigError(
            f"afd config: unknown key {field!r}.{hint} Allowed keys: "
            f"{', '.join(AFDConfig.model_fields)}; connector-specific options go in "
            "'connector_extra_config'.",
            field,
            raw.get(field),
        )
    if err["type"] == "missing":
        return AFDConfigError(
            f"afd config: required key {field!r} is missing; allowed: {_FIELD_HELP[field]}",
            field,
        )
    value = raw.get(field, err.get("input"))
    msg = err["msg"].removeprefix("Value error, ")
    allowed = _FIELD_HELP.get(field, "")
    return AFDConfigError(
        f"afd config: {loc}={value!r} is invalid: {msg}"
        + (f"; allowed: {allowed}" if allowed else ""),
        field,
        value,
    )


def default_connector(device_type: str | None = None) -> str:
    """The connector used when the config names none: the one for this platform."""
    if device_type is None:
        device_type = _current_device_type()
    from afd_core.connectors.registry import default_connector_for

    return default_connector_for(device_type)


def _current_device_type() -> str:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "cpu"
    from vllm.platforms import current_platform

    return current_platform.device_type


def parse_afd_config(raw: Any, device_type: str | None = None) -> AFDConfig:
    """Validate the value of the `afd` key; raise AFDConfigError on any bad input."""
    if not isinstance(raw, Mapping):
        raise AFDConfigError(
            f"afd config: the value of 'afd' must be a JSON object, got "
            f"{type(raw).__name__} {raw!r}",
            AFD_KEY,
            raw,
        )
    data = dict(raw)
    if data.get("connector") is None:
        data["connector"] = default_connector(device_type)
    try:
        cfg = AFDConfig.model_validate(data)
    except ValidationError as exc:
        errors = [_format_error(e, data) for e in exc.errors()]
        if len(errors) == 1:
            raise errors[0] from None
        first = errors[0]
        raise AFDConfigError("; ".join(str(e) for e in errors), first.field, first.value) from None
    spec = connector_spec(cfg.connector)  # known: the schema already checked the name
    if device_type is not None and device_type not in spec.device_types:
        usable = [
            n for n in available_connectors() if device_type in connector_spec(n).device_types
        ]
        raise AFDConfigError(
            f"afd config: connector={cfg.connector!r} runs on "
            f"{'/'.join(spec.device_types)}, but this platform is {device_type!r}; allowed "
            f"here: {', '.join(repr(n) for n in usable) or 'none'}",
            "connector",
            cfg.connector,
        )
    try:
        spec.validate_topology(cfg.num_attention_ranks, cfg.num_ffn_ranks)
    except ValueError as exc:
        raise AFDConfigError(
            f"afd config: connector {cfg.connector!r} cannot serve this shape: {exc}",
            "num_attention_ranks",
            cfg.num_attention_ranks,
        ) from None
    role_ranks = cfg.num_attention_ranks if cfg.is_attention else cfg.num_ffn_ranks
    name = "attention" if cfg.is_attention else "FFN"
    if cfg.start_rank >= role_ranks:
        raise AFDConfigError(
            f"afd config: start_rank={cfg.start_rank} is out of range for an {name} server "
            f"of a deployment with {role_ranks} {name} rank(s); allowed: 0.."
            f"{role_ranks - 1}",
            "start_rank",
            cfg.start_rank,
        )
    spec.parse_extra(cfg.connector_extra_config)  # raises AFDConfigError on a bad extra
    spec.validate_config(cfg)
    return cfg


def require_afd_config(vllm_config) -> AFDConfig:
    """The AFD config of a vLLM config that must have one (AFD workers, models)."""
    cfg = parse_optional_afd_config(vllm_config.additional_config)
    if cfg is None:
        raise AFDConfigError(
            "an AFD worker or AFD<arch> model was selected but the vLLM config has no 'afd' "
            "key in --additional-config; they only run inside an AFD deployment",
            "afd",
        )
    return cfg


def parse_optional_afd_config(
    additional_config: Any, device_type: str | None = None
) -> AFDConfig | None:
    """AFDConfig from vLLM's additional_config, or None when AFD is not active (no 'afd')."""
    if additional_config is None:
        return None
    if not isinstance(additional_config, Mapping):
        # vLLM may hold an object with compute_hash() instead of a dict; AFD needs a dict.
        return None
    if AFD_KEY not in additional_config:
        return None
    return parse_afd_config(additional_config[AFD_KEY], device_type)
