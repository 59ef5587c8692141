"""``python -m benchmarks``: the test rig's command line (``benchmarks.cli``)."""
from benchmarks.cli import app

app(prog_name="python -m benchmarks")
