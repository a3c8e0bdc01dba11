"""The AFD step engine, shared by every platform's attention workers.

`split` decides where a step splits into micro-batches (pure Python); `microbatch` runs the
micro-batches on persistent threads that hand a baton at the DBO yield op (no torch);
`wrapper` is the step wrapper around the attention model: one control message per forward,
per-micro-batch forward contexts, and the clean-up of a failed step (needs torch and vLLM).
"""
