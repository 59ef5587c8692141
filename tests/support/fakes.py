"""A fake mover: the scheduler half's tests run the manager's jobs through it, no bytes moved."""
from __future__ import annotations

from kvtier.jobs import Job, JobKind, JobResult
from kvtier.plan.manager import TierManager

__all__ = ["FakeMover"]


class FakeMover:
    """Runs nothing; answers every job as a mover would, with the failures it is told to report."""

    def __init__(self, manager: TierManager):
        self.manager = manager
        self.fail: set[int] = set()  # positions to report failed in the next job
        self.bad_reads: set[int] = set()  # ... and NVMe reads to report missing or corrupt

    def run(self, job: Job | None) -> JobResult | None:
        if job is None:
            return None
        failed = sorted(self.fail | self.bad_reads)
        result = JobResult(job_id=job.job_id, kind=job.kind, ok=not failed, failed=failed,
                           bad_reads=sorted(self.bad_reads), bytes_moved=sum(m.nbytes for m in job.moves))
        for i, move in enumerate(job.moves):
            if i not in failed and job.kind in (JobKind.STORE, JobKind.RESTORE, JobKind.FETCH):
                result.encoded[i] = (move.nbytes or self.manager.geometry.block_bytes, move.codec or "none")
        self.fail, self.bad_reads = set(), set()
        self.manager.complete(result)
        return result
