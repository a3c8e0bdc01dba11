"""afd-npu: Ascend NPU support for AFD. Importable without torch_npu or vllm_ascend; the
modules that need them import them where they are used."""

__version__ = "0.1.0"
