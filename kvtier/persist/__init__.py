"""What must survive a restart and be trusted: the session catalog (SQLite), snapshot files, the
snapshot signing keys (``trust``), secrets read from files (``secrets``) and model-weight
fingerprints (``weights``).

Rule: nothing here imports the worker half, the admin plane, the launcher or vLLM.
"""
