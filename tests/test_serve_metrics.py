"""The server's Prometheus metrics without a server: every engine gauge and counter reads its own stats
field, the disk tier's restore histogram is exposed with Prometheus's cumulative ``le`` buckets, and
the per-request latencies are measured from the right instants. Expected values are written by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlens.engine.scheduler import EngineStats
from kvlens.kv.disk import RESTORE_BUCKETS, DiskStats, LatencyHistogram
from kvlens.serve.metrics import ServeMetrics
from kvlens.serve.runner import Runner

# every field a different prime, so a metric that reads the wrong field shows a wrong number
STATS = dict(
    blocks_total=101, blocks_used=103, block_size=32, tokens_capacity=107, f16_tokens_same_bytes=109,
    bytes_per_token=113, running=5, waiting=7, preemptions=11, prompt_tokens=127, generated_tokens=131,
    prefix_hit_tokens=137, prefix_evictions=139, prefix_cached_blocks=149, peak_running=179,
    peak_blocks_used=181,
)  # fmt: skip
DISK = dict(spilled=151, restored=157, corrupt=163, failed=167, bytes=173)
STEP_FAULTS = 191  # the engine thread's count of steps that raised

# metric (as exposed) -> the stats field it reports, from the metric names and help texts
ENGINE_SERIES = {
    "kvlens_kv_blocks_used": "blocks_used",
    "kvlens_kv_blocks_total": "blocks_total",
    "kvlens_kv_tokens_capacity": "tokens_capacity",
    "kvlens_kv_f16_tokens_same_bytes": "f16_tokens_same_bytes",
    "kvlens_kv_bytes_per_token": "bytes_per_token",
    "kvlens_kv_block_size": "block_size",
    "kvlens_requests_running": "running",
    "kvlens_requests_waiting": "waiting",
    "kvlens_requests_running_peak": "peak_running",
    "kvlens_kv_blocks_used_peak": "peak_blocks_used",
    "kvlens_prefix_cached_blocks": "prefix_cached_blocks",
    "kvlens_prompt_tokens_total": "prompt_tokens",
    "kvlens_generation_tokens_total": "generated_tokens",
    "kvlens_preemptions_total": "preemptions",
    "kvlens_prefix_hit_tokens_total": "prefix_hit_tokens",
    "kvlens_prefix_evictions_total": "prefix_evictions",
}
DISK_SERIES = {
    "kvlens_kv_disk_blocks_spilled_total": "spilled",
    "kvlens_kv_disk_blocks_restored_total": "restored",
    "kvlens_kv_disk_corrupt_blocks_total": "corrupt",
    "kvlens_kv_disk_spill_failures_total": "failed",
    "kvlens_kv_disk_bytes": "bytes",
}


def parse_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus text exposition as (name, sorted labels) -> value, through
    Prometheus's own parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def samples(metrics: ServeMetrics) -> dict[tuple[str, tuple], float]:
    return parse_samples(metrics.render().decode())


def test_every_engine_series_reads_its_own_field():
    hist = LatencyHistogram()
    disk = DiskStats(**DISK, restore_seconds=hist)
    got = samples(ServeMetrics(lambda: EngineStats(**STATS, disk=disk), lambda: STEP_FAULTS))
    for name, field in ENGINE_SERIES.items():
        assert got[name, ()] == STATS[field], name
    for name, field in DISK_SERIES.items():
        assert got[name, ()] == DISK[field], name
    assert got["kvlens_engine_step_faults_total", ()] == STEP_FAULTS


def test_without_a_disk_tier_its_series_exist_at_zero():
    got = samples(ServeMetrics(lambda: EngineStats(**STATS), lambda: 0))
    assert all(got[name, ()] == 0 for name in DISK_SERIES)
    assert got["kvlens_kv_disk_restore_seconds_count", ()] == 0


def test_restore_histogram_has_cumulative_le_buckets():
    """By hand: 0.0001 lies on the first bound (``le`` is inclusive), two at 0.0003 fall in the
    0.0005 bucket, 2 s is above every bound (only +Inf counts it)."""
    assert RESTORE_BUCKETS[:3] == (0.0001, 0.00025, 0.0005) and RESTORE_BUCKETS[-1] == 1.0
    hist = LatencyHistogram()
    for seconds in (0.0001, 0.0003, 0.0003, 2.0):
        hist.observe(seconds)
    got = samples(ServeMetrics(lambda: EngineStats(**STATS, disk=DiskStats(restore_seconds=hist)), lambda: 0))
    name = "kvlens_kv_disk_restore_seconds"
    buckets = {dict(labels)["le"]: v for (n, labels), v in got.items() if n == f"{name}_bucket"}
    assert buckets["0.0001"] == 1 and buckets["0.00025"] == 1 and buckets["0.0005"] == 3
    assert buckets["1.0"] == 3 and buckets["+Inf"] == 4
    assert got[f"{name}_count", ()] == 4
    assert got[f"{name}_sum", ()] == pytest.approx(2.0007)


def test_latencies_are_measured_from_arrival_then_from_the_previous_token():
    """Arrival at t = 10; tokens at 10.5, 10.7 and 11.0: time to first token 0.5, then gaps of 0.2
    and 0.3 (the first gap from the first token, not from arrival)."""
    metrics = ServeMetrics(lambda: EngineStats(**STATS), lambda: 0)
    runner = SimpleNamespace(metrics=metrics)
    job = SimpleNamespace(arrived=10.0, first_at=None, last_at=None)
    for at in (10.5, 10.7, 11.0):
        Runner._observe(runner, job, at)
    got = samples(metrics)
    assert got["kvlens_time_to_first_token_seconds_count", ()] == 1
    assert got["kvlens_time_to_first_token_seconds_sum", ()] == pytest.approx(0.5)
    assert got["kvlens_inter_token_latency_seconds_count", ()] == 2
    assert got["kvlens_inter_token_latency_seconds_sum", ()] == pytest.approx(0.5)
    itl = {
        dict(labels)["le"]: v
        for (n, labels), v in got.items()
        if n == "kvlens_inter_token_latency_seconds_bucket"
    }
    assert itl["0.1"] == 0 and itl["0.25"] == 1 and itl["0.5"] == 2  # 0.2 and 0.3, not 0.7 and 1.0
