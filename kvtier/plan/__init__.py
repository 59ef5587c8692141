"""The scheduler half: every tiering decision, as jobs for the mover. No IO, no torch.

The tier manager (``manager``) is a facade over parts that each own their state: the block table
(``table``: index, policies, DRAM slots, the NVMe byte budget), the job book (``jobbook``), tier
health (``kvtier.tiers.health``), pressure and demotion (``pressure``), the session planner
(``sessions``), the catalog change log (``catalog_log``), read-only views (``views``) and the one
telemetry object (``telemetry``). Beside them: the index, the eviction policies, the cost model and
``decide`` (restore or recompute), and ``reasons`` (why a turn missed).

Rule: nothing here imports the worker half (``kvtier.move``), vLLM or torch.
"""
