"""Power-cut crash states from recorded IO (``python -m benchmarks faults --power``): the recorder
(``trace``), the crash-state builder (``states``), the recorded workloads (``workloads``), the
checks after a restart (``check``) and the run with its figures (``run``)."""
