"""``kvtier bench``: every figure a ratio against a reference measured in the same run (memcpy, raw
direct IO, recompute, plain vLLM). A layer above the core, as the CLI is; ``bench.vllm`` runs real vLLM."""
