"""Diagnostics: ``kvtier doctor`` (what this box can do: disks, links, needle figures) and the GPU
check (``gpucheck``: kvtier's CUDA paths on a lent GPU box).

Rule: only the CLI imports this package.
"""
