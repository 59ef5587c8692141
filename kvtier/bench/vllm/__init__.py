"""Benchmarks, the demo, the full-path GPU check and the harnesses that run real vLLM (in process or
as ``kvtier serve`` processes). The connector itself lives in ``kvtier.plugins.vllm``; nothing
there imports this package."""
