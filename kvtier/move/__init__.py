"""The worker half: runs the planner's jobs (copies, disk moves, snapshot files, shared fetches).

The mover never decides which block goes where: it executes ``kvtier.jobs.Job`` objects and
returns ``JobResult`` objects. It reaches the cold and shared tiers only through the
``kvtier.tiers.base.BlockStore`` interface.

Rule: nothing here imports the scheduler half (``kvtier.plan``) or vLLM.
"""
