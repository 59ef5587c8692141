"""Starting vLLM with kvtier inside: the launch plan (``serve``), preflight checks on the box
(``preflight``), the supervisor that runs, watches and stops the server process, a handle on a
running ``kvtier serve`` child (``served``) and the overnight demo it drives (``demo``).

Rule: the engine halves never import this package; it sits above them, beside the CLI.
"""
