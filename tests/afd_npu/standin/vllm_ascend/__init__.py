"""Stand-in vllm_ascend (see ../README.md)."""


def register():
    return "vllm_ascend.platform.NPUPlatform"
