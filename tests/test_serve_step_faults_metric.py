"""``kvlens_engine_step_faults_total`` on ``/metrics`` counts the engine steps that raised (a fault of the
scheduler's own, which ends every request in flight), and only those: a request whose own computation
failed ends alone and is not a fault of the step. An operator alerts on the first, not on bad requests."""

from __future__ import annotations

from test_serve_app import TINY_MODEL, app_parts, client, completion, llm  # noqa: F401
from test_serve_async_engine_fail import FAULTY_SEED, FaultySampler
from test_serve_metrics import parse_samples

import kvlens.engine.scheduler

STEP_FAULTS = ("kvlens_engine_step_faults_total", ())


def scrape(client) -> dict:  # noqa: F811
    return parse_samples(client.get("/metrics").text)


def test_a_fault_in_a_step_is_counted_once(app_parts, client):  # noqa: F811
    _, fault = app_parts
    before = scrape(client)[STEP_FAULTS]
    fault.arm()
    assert client.post("/v1/completions", json=completion()).status_code == 500
    assert scrape(client)[STEP_FAULTS] == before + 1
    assert client.post("/v1/completions", json=completion()).status_code == 200
    assert scrape(client)[STEP_FAULTS] == before + 1


def test_a_request_that_failed_alone_is_not_a_step_fault(client, monkeypatch):  # noqa: F811
    monkeypatch.setattr(kvlens.engine.scheduler, "Sampler", FaultySampler)
    before = scrape(client)
    r = client.post("/v1/completions", json=completion(temperature=1.0, seed=FAULTY_SEED))
    assert r.status_code == 500
    after = scrape(client)
    assert after[STEP_FAULTS] == before[STEP_FAULTS]
    key = ("kvlens_requests_total", (("endpoint", "completions"), ("finish_reason", "error")))
    assert after[key] == before.get(key, 0) + 1
