"""The storage tiers below the GPU: DRAM slots (``dram``), the NVMe segment store (``nvme``) and the
shared Valkey/Redis tier (``shared``), with the ``BlockStore`` interface (``base``) the mover uses
for every tier that is not DRAM, and the on-disk record format (``records``).

Rule: tiers never import the planner (``kvtier.plan``), the mover (``kvtier.move``), the admin
plane, the launcher or vLLM. A tier stores and returns bytes; it never decides placement.
"""
