"""The project's own test rig, run from a checkout and never shipped: fault, power-cut, trust and
slow-disk suites, the quality and needle benches with their retrieval models, scale, memory, the admin
plane, ``kvtier top``, the shared tier and restarts (``python -m benchmarks --help``), and the
recording and rendering of every benchmark's figures (``benchmarks.record``, ``benchmarks.render``).

What an operator measures on their own box stays in the product: ``kvtier bench`` (``kvtier.bench``).
This package sits above everything: it imports kvtier; nothing in kvtier imports it.
"""
