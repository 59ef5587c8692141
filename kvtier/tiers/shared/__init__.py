"""The shared tier: blocks and session entries in Valkey/Redis, signed so that a value written by
another box is checked before use. ``store.SharedStore`` is its ``BlockStore`` facade.
"""
