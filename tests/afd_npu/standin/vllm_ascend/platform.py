"""Stand-in of vllm_ascend/platform.py's NPUPlatform: the config steps AFD depends on, in
vllm-ascend 0.23's order (platform.py:449-796)."""

from vllm.platforms.interface import Platform, PlatformEnum

from vllm_ascend.ascend_config import init_ascend_config  # a module-level alias, as the real one

calls = []  # (worker_cls seen on entry, enable_dbo seen on entry), for tests


class NPUPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "npu"
    device_type = "npu"
    dispatch_key = "PrivateUse1"
    ray_device_key = "NPU"
    device_control_env_var = "ASCEND_RT_VISIBLE_DEVICES"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        pc = vllm_config.parallel_config
        calls.append((pc.worker_cls, pc.enable_dbo))
        cls._fix_incompatible_config(vllm_config)
        ascend_config = init_ascend_config(vllm_config)
        vllm_config.additional_config.setdefault("ascend_compilation_config", {}).update(
            ascend_config.ascend_compilation_config
        )
        if pc.worker_cls == "auto":
            if not getattr(vllm_config.compilation_config.pass_config, "enable_sp", False):
                pc.all2all_backend = "flashinfer_all2allv"  # keeps sequence-parallel MoE off
            if ascend_config.xlite_graph_config.get("enabled", False):
                pc.worker_cls = "vllm_ascend.xlite.xlite_worker.XliteWorker"
            else:
                pc.worker_cls = "vllm_ascend.worker.worker.NPUWorker"

    @staticmethod
    def _fix_incompatible_config(vllm_config) -> None:
        pc = vllm_config.parallel_config
        pc.enable_dbo = False  # "DBO is not supported on NPU"
        pc.ubatch_size = 0
        if vllm_config.additional_config is None:
            vllm_config.additional_config = {}
        vllm_config.additional_config.setdefault("enable_cpu_binding", True)
