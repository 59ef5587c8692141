"""The fault suite (``python -m benchmarks faults``): SIGKILL crash trials (``crash``), on-disk
corruption (``corrupt``), forged snapshots and paths (``trust``), the worlds they run in (``world``),
faults while ``kvtier serve`` serves (``serving``) and a disk that turns slow (``slowdisk``);
``suite`` runs them and names their figures."""
