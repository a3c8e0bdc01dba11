"""afd-models: role-aware MoE model wrappers for AFD on vLLM, and the tiny-checkpoint factory.

Importing this package needs neither torch nor vLLM; each wrapper module imports vLLM.
"""

__version__ = "0.1.0"
