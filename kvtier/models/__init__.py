"""Locally built models (no model hub): the demo Llama models ``kvtier serve`` runs with no MODEL,
and the retrieval model the needle benchmarks use.

Rule: these build checkpoints on disk; nothing in the engine halves imports them.
"""
