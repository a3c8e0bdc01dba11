"""afd-core: the platform-neutral heart of Attention-FFN Disaggregation for vLLM.

Importing this package needs the standard library alone; modules that need torch, vLLM or
pydantic import them themselves.
"""

__version__ = "0.1.0"
