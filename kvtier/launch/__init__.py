"""Starting vLLM with kvtier inside: the launch plan (``serve``), preflight checks on the box
(``preflight``) and the supervisor that runs, watches and stops the server process.

Rule: the engine halves never import this package; it sits above them, beside the CLI.
"""
