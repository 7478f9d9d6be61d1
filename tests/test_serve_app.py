"""The HTTP app's own paths (serve/app.py) in process: the real app, engine thread and engine over a
tiny model, driven through Starlette's TestClient (httpx). test_serve_http drives a real server
process; these are what a real server cannot be made to do on demand (a fault inside a step) and the
answers that need no model output (routes, the chat template, health).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from test_prefix_cache import engine_bytes_per_token

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig
from kvlens.kv.cache import BLOCK
from kvlens.serve.app import AppConfig, build_app

TINY_MODEL = ("llama", 5)  # conftest's tiny_dir; its tokenizer has no chat template
MODEL = "tiny"


class FaultyStep:
    """``Engine.step`` that raises while ``failing`` is set (a fault of the scheduler's own)."""

    def __init__(self, engine: Engine) -> None:
        self.failing, self._step = False, engine.step
        engine.step = self

    def __call__(self):
        if self.failing:
            raise RuntimeError("planted fault")
        return self._step()


@pytest.fixture(scope="module")
def app_parts(tiny_dir):
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba")
    engine = Engine(llm, EngineConfig(kv_budget_bytes=16 * BLOCK * engine_bytes_per_token(llm), max_batch=2))
    fault = FaultyStep(engine)
    with TestClient(build_app(llm, engine, AppConfig(MODEL))) as client:
        yield client, fault


@pytest.fixture
def client(app_parts):
    client, fault = app_parts
    fault.failing = False
    return client


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": [5, 17, 200, 33], "max_tokens": 3, **extra}


def test_an_unknown_route_is_a_404_not_found_error(client):
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_a_fault_in_a_step_is_a_500_server_error_and_the_server_goes_on(app_parts, client):
    _, fault = app_parts
    fault.failing = True
    r = client.post("/v1/completions", json=completion())
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "the engine failed while running request" in error["message"]
    fault.failing = False
    r = client.post("/v1/completions", json=completion())
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0


def test_a_fault_in_a_streamed_request_is_an_error_event_then_done(app_parts, client):
    _, fault = app_parts
    fault.failing = True
    with client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
        assert r.status_code == 200  # the stream had begun
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
