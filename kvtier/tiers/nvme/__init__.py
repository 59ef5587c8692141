"""The cold tier: block records in large segment files on a local drive, O_DIRECT, group commit,
merged reads, a checksummed index journal, hole punching and compaction. ``store.NvmeStore`` is
its ``BlockStore`` facade.
"""
