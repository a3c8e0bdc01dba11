"""Test-only: a Triton backend entry named "cpu", for Triton's interpreter.

Not a compiler. vLLM's CPU build runs model runner V2 only where Triton has a CPU backend
(`vllm/triton_utils/importing.py` looks for `backends["cpu"]`), and triton-cpu cannot be
installed on this machine. With `TRITON_INTERPRET=1`, Triton runs every `@triton.jit`
kernel in its interpreter on CPU tensors and never compiles, so a backend entry that only
says "a CPU driver is active" is enough for vLLM's check and for Triton's driver lookup.
Kept out of the published packages; see docs/development.md ("Model runner V2 on CPU").
"""
