"""``kvtier bench agents``: an agent workload (many-turn sessions, tool-call pauses, subagents)
replayed against several serving arms with equal engine flags: plain vLLM, plain vLLM with a KV
cache big enough for everything (the floor), kvtier, vLLM's own offloading and LMCache.

``trace`` makes the workload (seeded, or read from a JSONL file), ``regimes`` sizes it from the
box, ``load`` replays it against one server, ``arms`` starts the servers, ``report`` turns the
per-request records into the figures and the picture, ``run`` puts them together.
"""
