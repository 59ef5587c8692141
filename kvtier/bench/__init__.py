"""``kvtier bench``: what an operator measures on their own box and model, every figure a ratio
against a reference measured in the same run (memcpy, raw direct IO, recompute, plain vLLM): the tiers
(``tiers``), a GB-scale restore (``restore``), the codecs (``codecs``), restore vs recompute through
real vLLM (``serve``), the cost model (``costmodel``) and agent sessions (``agents``). ``harness``
runs vLLM with kvtier in this process; ``checks`` refuses a figure whose precondition did not hold.

A layer above the core, as the CLI is. The project's own test rig is ``benchmarks/``, beside the
package and not shipped."""
