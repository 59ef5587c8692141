"""kvtier: a tiered KV cache for vLLM (GPU HBM, host DRAM, NVMe, a shared Valkey/Redis tier).

The root holds only the vocabulary both halves share: ``layout`` (KV geometry, fingerprints),
``jobs`` (what the planner asks the mover to do), ``engine`` (both halves in one process),
``config`` and ``connector_config`` (settings), ``errors`` and ``units``. Everything else lives in a
folder per role: ``plan`` (scheduler half), ``move`` (worker half), ``tiers``, ``persist``,
``codecs``, ``control`` (admin plane), ``launch``, ``diagnose``, ``models``, ``cli``, ``bench``;
the connector is ``kvtier.plugins.vllm`` and the dashboard ``kvtier.tui``.

Rule: the core never imports ``cli``, ``bench``, ``plugins`` or ``tui`` (tests/unit/structure/test_imports.py).
"""
