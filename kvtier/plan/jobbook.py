"""The job book: every job the tier manager emitted and the mover has not finished yet, the jobs
planned to ship with the next maintenance, and the one sequence of job ids."""
from __future__ import annotations

import itertools

from kvtier.errors import UsageError
from kvtier.jobs import Job, JobKind

__all__ = ["JobBook"]


class JobBook:
    """Owns ``jobs`` (id -> unfinished job), ``queued`` (planned jobs for the next maintenance) and
    the job id sequence."""

    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.queued: list[Job] = []
        self._ids = itertools.count(1)

    def new_job_id(self) -> int:
        """A job id no job has had (the admin API numbers its no-op answers from the same sequence)."""
        return next(self._ids)

    def new_job(self, kind: JobKind, **fields) -> Job:
        """A new job, registered as unfinished until ``pop`` takes it back."""
        job = Job(job_id=self.new_job_id(), kind=kind, **fields)
        self.jobs[job.job_id] = job
        return job

    def pop(self, job_id: int) -> Job:
        """Take back a finished job; UsageError when no such job is unfinished."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            raise UsageError(f"job {job_id} is not pending")
        return job

    def queue(self, job: Job) -> None:
        """Ship ``job`` with the next maintenance."""
        self.queued.append(job)

    def take_queued(self) -> list[Job]:
        """The queued jobs, leaving none queued."""
        queued, self.queued = self.queued, []
        return queued
