"""Read-only views of the tier manager's state: per-session status rows, state counts, tier
capacity in tokens, what a crash would lose, and the whole ``stats`` answer of the admin plane.

``Views`` owns nothing but a cached copy of the fingerprint's dict; it reads the block table, the
job book and the telemetry, and changes none of them.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from kvtier.codecs import get_codec
from kvtier.layout import ModelFingerprint
from kvtier.plan.index import IN_DRAM, IN_NVME, PENDING, Session
from kvtier.plan.jobbook import JobBook
from kvtier.plan.table import BlockTable
from kvtier.plan.telemetry import Telemetry
from kvtier.tiers.nvme.store import file_bytes_for

__all__ = ["SESSION_STATES", "Views"]

SESSION_STATES = ("pinned", "hot", "warm", "cold", "gone")  # in the order session_state tests them


class Views:
    def __init__(self, table: BlockTable, jobs: JobBook, telemetry: Telemetry, fingerprint: ModelFingerprint):
        self.table, self.jobs, self.telemetry = table, jobs, telemetry
        self.fingerprint, self.geometry = fingerprint, fingerprint.geometry
        self._fingerprint_dict: dict[str, Any] | None = None
        # session -> its blocks in vLLM's prefix cache (HBM), where the engine publishes its KV cache
        # events (the connector's ``HbmCache.sessions``); None: running requests only (``Session.hot``)
        self.hbm_blocks: Callable[[], dict[str, int]] | None = None

    def follow_hbm(self, blocks: Callable[[], dict[str, int]]) -> None:
        """Show each session's share of vLLM's prefix cache, as ``blocks()`` answers it."""
        self.hbm_blocks = blocks

    def session_counts(self, sessions: list[Session]) -> dict[str, np.ndarray]:
        """Per session: blocks and bytes held complete in DRAM and on NVMe (vectorised)."""
        per_session = [self.table.session_row_array(session) for session in sessions]
        col = self.table.index.col
        idx = np.concatenate(per_session) if per_session else np.zeros(0, np.int64)
        who = np.repeat(np.arange(len(sessions), dtype=np.int64), [len(rows) for rows in per_session])
        flags = col["flags"][idx]
        complete = (flags & PENDING) == 0
        in_dram = complete & ((flags & IN_DRAM) != 0)
        in_nvme = complete & ((flags & IN_NVME) != 0)

        def count(weights) -> np.ndarray:
            return np.bincount(who, weights=weights, minlength=len(sessions)).astype(np.int64)

        shards = self.fingerprint.shards  # bytes are the box's: every rank holds a shard of each block
        in_hbm = self.hbm_blocks() if self.hbm_blocks is not None else {}
        blocks_hbm = np.fromiter((in_hbm.get(s.session_id, 0) for s in sessions), np.int64, len(sessions))
        return {"blocks_hbm": blocks_hbm, "bytes_hbm": blocks_hbm * self.geometry.block_bytes * shards,
                "blocks_dram": count(in_dram), "blocks_nvme": count(in_nvme), "blocks_both": count(in_dram & in_nvme),
                "bytes_dram": count(col["dram_nbytes"][idx] * in_dram) * shards,
                "bytes_nvme": count(col["nvme_nbytes"][idx] * in_nvme) * shards}

    def session_info(self, session_id: str) -> dict[str, Any]:
        """One session's row of ``sessions_overview`` (NotFoundError when there is no such session)."""
        return self.sessions_overview([self.table.session(session_id).session_id])[0]

    def sessions_overview(self, session_ids: list[str] | None = None) -> list[dict[str, Any]]:
        """``session_info`` for many sessions at once (vectorised: 1,000 sessions in a few ms)."""
        ids = list(self.table.sessions) if session_ids is None else session_ids
        sessions = [self.table.sessions[s] for s in ids]
        counts = {name: values.tolist() for name, values in self.session_counts(sessions).items()}
        hbm = self.hbm_blocks is not None
        now, wall = time.time(), self.table.wall_clock()
        state = self.session_state
        block_tokens = self.geometry.block_tokens
        return [{
            "session_id": session.session_id,
            "state": state(session, dram, nvme, in_hbm),
            # what a next turn can load: the tokens of its full stored blocks, for a session read back
            # from the catalog as for one served here (its last prompt's length is prompt_tokens)
            "tokens": min(session.num_tokens, session.num_blocks * block_tokens),
            "prompt_tokens": session.num_tokens,
            "blocks": session.num_blocks,
            "blocks_missing": max(0, session.num_blocks - dram - nvme + both),
            "blocks_dram": dram,
            "blocks_nvme": nvme,
            "bytes_dram": b_dram,
            "bytes_nvme": b_nvme,
            # its blocks in vLLM's prefix cache (None: the engine publishes no KV cache events)
            "blocks_hbm": in_hbm if hbm else None,
            "bytes_hbm": b_hbm if hbm else None,
            "pinned": session.pinned.name.lower() if session.pinned is not None else None,
            **self._time_limits(session, wall),
            "last_use": session.last_use,
            "idle_seconds": max(0.0, now - session.last_use),
        } for session, dram, nvme, both, b_dram, b_nvme, in_hbm, b_hbm in zip(
            sessions, counts["blocks_dram"], counts["blocks_nvme"], counts["blocks_both"], counts["bytes_dram"],
            counts["bytes_nvme"], counts["blocks_hbm"], counts["bytes_hbm"])]

    @staticmethod
    def _time_limits(session: Session, now: float) -> dict[str, Any]:
        """When a timed pin ends and how long a live retention hint has left (None: none)."""
        pin_ends = session.pin_expires if session.pinned is not None else None
        retained = session.retain_until is not None and session.retain_until > now
        return {"pin_expires_at": pin_ends, "pin_left_s": None if pin_ends is None else max(0.0, pin_ends - now),
                "retain_expires_at": session.retain_until if retained else None,
                "retain_left_s": session.retain_until - now if retained else None,
                "retain_priority": session.retain_priority if retained else None}

    def session_state_counts(self) -> dict[str, int]:
        """How many sessions are in each state (``session_state``), without building the rows."""
        sessions = list(self.table.sessions.values())
        states = self._state_codes(sessions, self.session_counts(sessions))
        found = np.bincount(states, minlength=5).tolist()
        return dict(zip(SESSION_STATES, found))

    @staticmethod
    def _state_codes(sessions: list[Session], counts: dict[str, np.ndarray]) -> np.ndarray:
        """Per session, its state as an index into ``SESSION_STATES`` (vectorised ``session_state``)."""
        dram, nvme = counts["blocks_dram"], counts["blocks_nvme"]
        pinned = np.fromiter((s.pinned is not None for s in sessions), bool, len(sessions))
        hot = np.fromiter((s.hot for s in sessions), bool, len(sessions)) | (counts["blocks_hbm"] > 0)
        warm = (dram > 0) & (dram >= nvme)
        return np.select([pinned, hot, warm, nvme > 0], [0, 1, 2, 3], 4)

    def sessions_page(self, sort: str = "last_use", state: str | None = None,
                      limit: int | None = None) -> tuple[list[dict[str, Any]], int]:
        """The first ``limit`` rows of ``sessions_overview`` (those in ``state``; None: all) in ``sort``
        order, and how many sessions there are in it. ``last_use``, ``tokens`` and ``bytes`` sort the
        largest first; ``session_id`` and ``state`` alphabetically; ties keep the sessions' order. The
        order is found on numpy columns and only the rows returned are built (with 100k sessions a
        page of 50 rows costs a fraction of building them all)."""
        sessions = list(self.table.sessions.values())
        n = len(sessions)
        counts = self.session_counts(sessions)
        chosen = np.arange(n)
        if state is not None:
            chosen = np.flatnonzero(self._state_codes(sessions, counts) == SESSION_STATES.index(state))
        if sort == "session_id":
            order = np.asarray(sorted(chosen.tolist(), key=lambda i: sessions[i].session_id), dtype=np.int64)
        else:
            if sort == "last_use":
                key = -np.fromiter((s.last_use for s in sessions), np.float64, n)
            elif sort == "tokens":
                block_tokens = self.geometry.block_tokens
                key = -np.fromiter((min(s.num_tokens, s.num_blocks * block_tokens) for s in sessions), np.int64, n)
            elif sort == "bytes":
                key = -(counts["bytes_dram"] + counts["bytes_nvme"])
            elif sort == "state":
                alphabetical = np.argsort(np.argsort(np.asarray(SESSION_STATES)))  # state index -> its rank by name
                key = alphabetical[self._state_codes(sessions, counts)]
            else:
                raise ValueError(f"cannot sort sessions by {sort!r}")
            order = chosen[np.argsort(key[chosen], kind="stable")]
        shown = order if limit is None else order[:limit]
        return self.sessions_overview([sessions[i].session_id for i in shown.tolist()]), len(chosen)

    def session_state(self, session: Session, in_dram: int, in_nvme: int, in_hbm: int = 0) -> str:
        # keep in step with _state_codes. Hot: a request of it runs, or vLLM's prefix cache holds
        # some of its blocks (its next turn hits there first)
        if session.pinned is not None:
            return "pinned"
        if session.hot or in_hbm:
            return "hot"
        if in_dram and in_dram >= in_nvme:
            return "warm"
        if in_nvme:
            return "cold"
        return "gone"

    def tokens_per_gib(self) -> dict[str, int]:
        """How many tokens of KV one GiB holds in each tier, with its codec (HBM: vLLM's KV dtype)."""
        geometry = self.geometry
        cold = get_codec(self.table.cold_codec)
        on_disk = cold.nbytes_for(geometry)
        if on_disk is None:  # zstd: the average of what is stored, else the worst case
            col = self.table.index.col
            in_nvme = (col["flags"] & IN_NVME) != 0
            on_disk = int(col["nvme_nbytes"][in_nvme].mean()) if in_nvme.any() else cold.max_bytes(geometry)
        per_block = {"hbm": geometry.block_bytes, "dram": self.table.slots.slot_bytes, "nvme": file_bytes_for(on_disk)}
        shards = self.fingerprint.shards  # a token's KV spans every rank's shard
        return {tier: int((1 << 30) * geometry.block_tokens // (size * shards)) for tier, size in per_block.items()}

    def fingerprint_view(self) -> dict[str, Any]:
        view = self._fingerprint_dict
        if view is None:  # the fingerprint never changes; its dict costs a deepcopy to build
            view = self._fingerprint_dict = self.fingerprint.to_dict()
        return {**view, "geometry": dict(view["geometry"])}

    def stats(self) -> dict[str, Any]:
        capacity = self.tokens_per_gib()
        shards = self.fingerprint.shards  # the box's bytes: the budgets are split across the ranks
        slots, nvme, flags = self.table.slots, self.table.nvme, self.table.index.col["flags"]
        return {
            "fingerprint": self.fingerprint_view(),
            "hbm": {"kv_dtype": self.geometry.dtype, "tokens_per_gib": capacity["hbm"]},
            "dram": {"used_bytes": slots.used_bytes * shards, "capacity_bytes": slots.capacity_bytes * shards,
                     "blocks": int(((flags & IN_DRAM) != 0).sum()),
                     "codec": self.table.warm_codec, "tokens_per_gib": capacity["dram"]},
            "nvme": {"used_bytes": nvme.used * shards, "capacity_bytes": nvme.capacity * shards,
                     "blocks": int(((flags & IN_NVME) != 0).sum()),
                     "codec": self.table.cold_codec, "tokens_per_gib": capacity["nvme"]},
            "dirty": self.dirty_stats(),
            "sessions": len(self.table.sessions),
            "jobs_in_flight": len(self.jobs.jobs),
            "counters": dict(self.telemetry.counters),
            "warnings": dict(self.telemetry.warnings),
        }

    def dirty_stats(self) -> dict[str, float]:
        """What a crash would lose now: DRAM-only blocks, their bytes, and the oldest one's age (s)."""
        rows = self.table.index.dirty_rows()
        storing = self.table.index.storing_count()  # not dirty yet: their stores run behind the step
        if not len(rows):
            return {"dirty_blocks": 0, "dirty_bytes": 0, "dirty_age_s": 0.0, "storing_blocks": storing}
        col = self.table.index.col
        return {"dirty_blocks": int(len(rows)), "dirty_bytes": int(col["dram_nbytes"][rows].sum()),
                "dirty_age_s": round(max(0.0, self.table.index.now() - float(col["dirty_since"][rows].min())), 3),
                "storing_blocks": storing}
