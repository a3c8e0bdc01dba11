"""Stand-in of vllm_ascend/ascend_config.py: AscendConfig reads `additional_config` with
.get (unknown keys are ignored), and init_ascend_config caches one instance per vllm_config
unless `refresh` is set. STRICT makes AscendConfig reject unknown top-level keys, as a
stricter vllm-ascend could."""

KNOWN_KEYS = {
    "ascend_compilation_config",
    "ascend_fusion_config",
    "xlite_graph_config",
    "eplb_config",
    "enable_cpu_binding",
    "recompute_scheduler_enable",
    "refresh",
}
STRICT = False
built = []  # the AscendConfig instances built, for tests


class AscendConfig:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        additional = (
            vllm_config.additional_config if vllm_config.additional_config is not None else {}
        )
        if STRICT:
            unknown = sorted(set(additional) - KNOWN_KEYS)
            if unknown:
                raise ValueError(f"additional_config has unknown keys {unknown}")
        self.seen_keys = sorted(additional)
        self.ascend_compilation_config = dict(additional.get("ascend_compilation_config", {}))
        self.eplb_config = dict(additional.get("eplb_config", {}))
        self.xlite_graph_config = dict(additional.get("xlite_graph_config", {}))
        built.append(self)


_ASCEND_CONFIG = None


def init_ascend_config(vllm_config):
    global _ASCEND_CONFIG
    additional = vllm_config.additional_config or {}
    if (
        _ASCEND_CONFIG is not None
        and not additional.get("refresh", False)
        and _ASCEND_CONFIG.vllm_config is vllm_config
    ):
        return _ASCEND_CONFIG
    _ASCEND_CONFIG = AscendConfig(vllm_config)
    return _ASCEND_CONFIG


def clear_ascend_config():
    global _ASCEND_CONFIG
    _ASCEND_CONFIG = None


def get_ascend_config():
    if _ASCEND_CONFIG is None:
        raise RuntimeError(
            "Ascend config is not initialized. Please call init_ascend_config first."
        )
    return _ASCEND_CONFIG
