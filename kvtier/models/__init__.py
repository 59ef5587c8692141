"""Locally built models (no model hub): the demo Llama models ``kvtier serve`` runs with no MODEL
(the test rig's retrieval models build on its helpers).

Rule: these build checkpoints on disk; nothing in the engine halves imports them.
"""
