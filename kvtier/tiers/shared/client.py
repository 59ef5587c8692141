"""The connection to the shared store and its health.

``SharedClient`` owns the redis-py client (standalone or a cluster, found out on connecting), the
lock around it, the credentials, and the back-off (``kvtier.tiers.health.Backoff``): every call has
a short socket timeout and no client-side retries, and after a failure (down, paused, full, wrong
credentials) the store is skipped for a back-off (0.5 s doubling to 8 s) during which every call
answers ``SharedUnavailable`` at once. The first call after the back-off is the probe; ``state``
and ``problem`` say what is wrong for ``status`` and ``kvtier top``. It also measures the link
(``measure``) and reads the server's memory figures (``server_info``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Any, Callable, Mapping, TypeVar

from kvtier.errors import SharedUnavailable
from kvtier.tiers.health import Backoff, Clock
from kvtier.tiers.shared.config import SharedConfig, display_url, load_credentials
from kvtier.tiers.shared.resp import ZeroCopyPacker, packed_connection

__all__ = ["SharedClient", "BACKOFF_MIN_S", "BACKOFF_MAX_S"]

log = logging.getLogger(__name__)

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 8.0

T = TypeVar("T")


class SharedClient:
    """One rank's connection to the store. Thread-safe. Counts ``skipped_down``, ``errors`` and
    ``recoveries``."""

    def __init__(self, config: SharedConfig, rank: int = 0, env: Mapping[str, str] | None = None,
                 clock: Clock = time.monotonic):
        self.config = config
        self.rank = rank
        self.url = display_url(config.url)
        self.username, self.password = load_credentials(config.auth_file, env)
        self.backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S, clock)
        self.counters: Counter[str] = Counter()
        self.state = "unknown"  # ok | down | unknown (never reached yet)
        self.problem: str | None = None  # why it is down, for status
        self.cluster = False
        self.rtt_s: float | None = None
        self.read_bps: float | None = None
        self._client: Any = None
        self._lock = threading.Lock()

    # ---- connection -----------------------------------------------------------------------------
    def _connect(self):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        timeout = self.config.timeout_s
        common = dict(username=self.username, password=self.password, socket_timeout=timeout,
                      socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), health_check_interval=0,
                      socket_read_size=1 << 20,  # blocks are large: fewer, larger recv()s
                      protocol=2)  # RESP2: what get_into parses (redis-py 8 asks for RESP3 by default)
        if self.config.url.startswith("rediss://") and self.config.ca_file:
            common["ssl_ca_certs"] = self.config.ca_file
        # values go out as (header, payload) without being joined or copied (ZeroCopyPacker)
        client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(
            self.config.url, command_packer=ZeroCopyPacker(), **common))
        if not self.config.url.startswith("unix://"):
            try:
                enabled = str(client.info("cluster").get("cluster_enabled", 0)) == "1"
            except redis.ResponseError:  # a server without the cluster section
                enabled = False
            if enabled:
                from redis.cluster import RedisCluster

                client.close()
                client = RedisCluster.from_url(self.config.url,
                                               connection_class=packed_connection(self.config.url), **common)
                self.cluster = True
        return client

    def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)``; any failure opens the back-off. Raises ``SharedUnavailable`` at once
        while the back-off lasts, so nobody waits on a store known to be down."""
        import redis

        if self.backoff.waiting:
            self.counters["skipped_down"] += 1
            raise SharedUnavailable(f"shared store {self.url} is {self.problem or 'down'}")
        try:
            with self._lock:
                client = self._client
            if client is None:
                client = self._connect()
                with self._lock:
                    self._client = client
            result = fn(client)
        except (redis.RedisError, OSError, ValueError) as exc:
            self.failed(exc)
            raise self.unavailable() from None
        if self.state != "ok":
            if self.state == "down":
                log.warning("kvtier: shared store %s is back", self.url)
                self.counters["recoveries"] += 1
            self.state, self.problem = "ok", None
            self.backoff.succeeded()
        return result

    def unavailable(self) -> SharedUnavailable:
        """The error a call that failed reports (what is wrong with the store)."""
        return SharedUnavailable(f"shared store {self.url}: {self.problem}")

    def failed(self, exc: BaseException) -> None:
        """Note a failure (of a call, or one reply of a pipeline): say why, open the back-off, and
        start over with fresh connections (a paused or restarted server)."""
        import redis

        if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in str(exc) or "NOAUTH" in str(exc):
            problem = "refusing our credentials (check --shared-auth-file / KVTIER_SHARED_PASSWORD)"
        elif isinstance(exc, redis.TimeoutError) or "timed out" in str(exc).lower():
            problem = f"not answering within {self.config.timeout_s:g} s"
        elif type(exc).__name__ == "OutOfMemoryError" or str(exc).startswith(("OOM",
                                                                              "command not allowed when used memory")):
            problem = "full (maxmemory reached and its policy evicts nothing)"
        elif isinstance(exc, (redis.ConnectionError, OSError)):
            problem = f"unreachable ({str(exc).splitlines()[0][:120]})"
        else:
            problem = f"failing ({type(exc).__name__}: {str(exc)[:120]})"
        delay = self.backoff.failed()
        if self.state != "down" or problem != self.problem:
            log.warning("kvtier: shared store %s is %s; retrying in %.1f s", self.url, problem, delay)
        self.state, self.problem = "down", problem
        self.counters["errors"] += 1
        self.close()

    @property
    def available(self) -> bool:
        """Whether a call now would be tried (not inside a back-off)."""
        return not self.backoff.waiting

    def retry_now(self) -> None:
        """End the back-off at once: the next call is the probe."""
        self.backoff.retry_now()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken client
                pass

    # ---- measurement ----------------------------------------------------------------------------
    def ping(self) -> float:
        """One round trip, in seconds (raises ``SharedUnavailable``)."""
        start = time.perf_counter()
        self.call(lambda c: c.ping())
        return time.perf_counter() - start

    def measure(self, nbytes: int = 4 << 20, pings: int = 5) -> tuple[float, float]:
        """(read GB/s as bytes per second, round trip in seconds): a few PINGs, then one value of
        ``nbytes`` written and read back twice (the best read counts)."""
        rtt = min(self.ping() for _ in range(pings))
        name = b"kvt1:probe:%d:%d" % (os.getpid(), self.rank)
        data = os.urandom(nbytes)
        self.call(lambda client: client.set(name, data, ex=60))
        best = float("inf")
        try:
            for _ in range(2):
                start = time.perf_counter()
                value = self.call(lambda client: client.get(name))
                best = min(best, time.perf_counter() - start)
                if value is None or len(value) != nbytes:
                    raise SharedUnavailable(f"shared store {self.url} lost a probe value at once (evicting?)")
        finally:
            try:
                self.call(lambda client: client.delete(name))
            except SharedUnavailable:
                pass
        self.rtt_s, self.read_bps = rtt, nbytes / max(best - rtt, best / 2)
        return self.read_bps, rtt

    def server_info(self) -> dict:
        """Memory, eviction and key counts as the server reports them (summed over a cluster's nodes)."""
        fields = ("used_memory", "maxmemory", "evicted_keys", "expired_keys")

        def read(client):
            info = client.info()
            nodes = list(info.values()) if self.cluster and all(isinstance(v, dict) for v in info.values()) else [info]
            merged = {name: sum(int(node.get(name, 0) or 0) for node in nodes) for name in fields}
            merged["nodes"] = len(nodes)
            merged["maxmemory_policy"] = str(nodes[0].get("maxmemory_policy", "")) if nodes else ""
            return merged

        return self.call(read)
