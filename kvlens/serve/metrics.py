"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own.

Pool and queue gauges and the token counters are read from the engine's latest stats snapshot at
scrape time (one source of truth: ``EngineStats``), the count of engine steps that raised from the
engine thread's own counter; latencies are observed by the HTTP layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..engine.serving import EngineStats
from ..kv.disk import DiskStats

# Seconds: a decode step of a small model on a laptop CPU is ~10-100 ms; a long prefill, seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

_GAUGES = {
    "kvlens_kv_blocks_used": ("KV blocks owned by sequences", "blocks_used"),
    "kvlens_kv_blocks_total": ("KV blocks in the pool", "blocks_total"),
    "kvlens_kv_tokens_capacity": ("token positions the pool holds", "tokens_capacity"),
    "kvlens_kv_f16_tokens_same_bytes": (
        "token positions an f16 pool of the same bytes holds",
        "f16_tokens_same_bytes",
    ),
    "kvlens_kv_bytes_per_token": ("KV bytes per token position (all layers) in this mode", "bytes_per_token"),
    "kvlens_kv_block_size": ("token positions per block", "block_size"),
    "kvlens_requests_running": ("sequences in the running batch", "running"),
    "kvlens_requests_running_peak": (
        "most sequences in the running batch at once, since start",
        "peak_running",
    ),
    "kvlens_kv_blocks_used_peak": (
        "most KV blocks owned by sequences at once, since start",
        "peak_blocks_used",
    ),
    "kvlens_requests_waiting": ("requests in the waiting queue", "waiting"),
    "kvlens_prefix_cached_blocks": (
        "unreferenced prefix-cache blocks kept in the pool",
        "prefix_cached_blocks",
    ),
}
_COUNTERS = {
    "kvlens_prompt_tokens": ("prompt tokens admitted", "prompt_tokens"),
    "kvlens_generation_tokens": ("tokens generated", "generated_tokens"),
    "kvlens_preemptions": ("sequences preempted (blocks freed, recomputed later)", "preemptions"),
    "kvlens_prefix_hit_tokens": (
        "prompt tokens served from the prefix cache (memory or disk)",
        "prefix_hit_tokens",
    ),
    "kvlens_prefix_evictions": ("prefix-cache blocks evicted from the pool", "prefix_evictions"),
}
_DISK_COUNTERS = {
    "kvlens_kv_disk_blocks_spilled": ("prefix blocks written to the disk tier", "spilled"),
    "kvlens_kv_disk_blocks_restored": ("prefix blocks restored from the disk tier", "restored"),
    "kvlens_kv_disk_corrupt_blocks": (
        "block files refused on restore (checksum/header/length), deleted",
        "corrupt",
    ),
    "kvlens_kv_disk_spill_failures": (
        "evicted blocks not spilled: their file could not be written (disk full, folder gone)",
        "failed",
    ),
}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], step_faults: Callable[[], int]) -> None:
        self._stats, self._step_faults = stats, step_faults

    def collect(self) -> Iterator:
        s = self._stats()
        yield CounterMetricFamily(
            "kvlens_engine_step_faults",
            "engine steps that raised (the requests in flight ended with finish_reason error)",
            value=self._step_faults(),
        )
        for name, (doc, attr) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(s, attr))
        for name, (doc, attr) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(s, attr))
        disk = s.disk or DiskStats()  # no disk tier: zeros, so the series always exist
        for name, (doc, attr) in _DISK_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(disk, attr))
        yield GaugeMetricFamily(
            "kvlens_kv_disk_bytes", "bytes of block files in the disk tier", value=disk.bytes
        )
        h = disk.restore_seconds
        cumulative = [sum(h.counts[: i + 1]) for i in range(len(h.counts))]
        buckets = [(str(b), c) for b, c in zip(h.bounds, cumulative, strict=False)] + [
            ("+Inf", cumulative[-1])
        ]
        yield HistogramMetricFamily(
            "kvlens_kv_disk_restore_seconds", "time to read, check and copy one block back", buckets, h.total
        )


# The metrics the HTTP layer observes per request: attribute -> (name, doc, histogram buckets).
_LATENCIES = {
    "ttft": (
        "kvlens_time_to_first_token_seconds",
        "request arrival to its first generated token",
        TTFT_BUCKETS,
    ),
    "itl": (
        "kvlens_inter_token_latency_seconds",
        "time between consecutive tokens of a request",
        ITL_BUCKETS,
    ),
}
# attribute -> (name, doc, label names)
_REQUEST_COUNTERS = {
    "requests": (
        "kvlens_requests",
        "requests answered, by endpoint and finish reason",
        ("endpoint", "finish_reason"),
    ),
    "errors": ("kvlens_request_errors", "requests refused, by HTTP status", ("status",)),
}


class ServeMetrics:
    ttft: Histogram
    itl: Histogram
    requests: Counter
    errors: Counter

    def __init__(self, stats: Callable[[], EngineStats], step_faults: Callable[[], int]) -> None:
        """``stats``: the engine's latest snapshot; ``step_faults``: how many of its steps raised
        (``AsyncEngine.faults``), both read at scrape time."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, step_faults))
        for attr, (name, doc, buckets) in _LATENCIES.items():
            setattr(self, attr, Histogram(name, doc, buckets=buckets, registry=self.registry))
        for attr, (name, doc, labels) in _REQUEST_COUNTERS.items():
            setattr(self, attr, Counter(name, doc, labels, registry=self.registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)
