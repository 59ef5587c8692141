"""Integrations installed under ``kvtier.plugins``: today the vLLM KV connector (``vllm``)."""
