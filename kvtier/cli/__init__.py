"""The `kvtier` command (typer): ``main`` (serve, demo, config, doctor), ``admin`` (the session
commands over the admin API), ``top``, ``bench``, ``output`` (tables, JSON, errors with hints)."""
