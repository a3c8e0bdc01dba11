"""A registered AFD architecture whose wrapper is not in this release yet."""

from __future__ import annotations

import torch.nn as nn


def not_implemented_model(name: str, planned: str) -> type[nn.Module]:
    """An nn.Module class that vLLM can inspect, but that refuses to be built.

    `afd_not_implemented` holds the reason: AFD's start-up check reads it and stops the
    server before any resource exists."""
    reason = (
        f"{name} is registered but not implemented in afd-models "
        f"{__import__('afd_models').__version__}: {planned}"
    )

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(reason)

    return type(
        name,
        (nn.Module,),
        {"__init__": __init__, "__module__": __name__, "afd_not_implemented": reason},
    )
