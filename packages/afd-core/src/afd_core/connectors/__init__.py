"""AFD connectors: the data and control planes between attention and FFN ranks.

`registry` (no torch) names every connector and its config schema; `base` is the interface;
`factory` builds one; each transport lives in a module of its own.
"""
