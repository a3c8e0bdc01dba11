"""AFD role workers for vLLM-Ascend."""
