"""40 hostile calls on the serving engine's Python entries (a tiny random Llama; twenty-third session).
Run: python docs/testing/bad-input-sweep23/api_probe.py  (from the repository root, tests/ on the path)."""

import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from tiny_models import write_hf  # noqa: E402

import kvlens  # noqa: E402
from kvlens.engine.sampling import SamplingParams  # noqa: E402
from kvlens.engine.scheduler import Engine, EngineConfig, Request, run_alone, run_batch  # noqa: E402

d = pathlib.Path(tempfile.mkdtemp()) / "hf"
write_hf("llama", d, seed=1)
llm = kvlens.load(d, kv="q8")
eng = lambda: Engine(llm, EngineConfig(kv_budget_bytes=1 << 20))  # noqa: E731
cases = {
    "EngineConfig(max_batch=0)": lambda: EngineConfig(max_batch=0),
    "EngineConfig(kv_budget_bytes=-1)": lambda: Engine(llm, EngineConfig(kv_budget_bytes=-1)),
    "EngineConfig(kv_budget_bytes=1.5)": lambda: Engine(llm, EngineConfig(kv_budget_bytes=1.5)),
    "EngineConfig(kv_budget_bytes='1GiB')": lambda: Engine(llm, EngineConfig(kv_budget_bytes="1GiB")),
    "EngineConfig(max_waiting=-1)": lambda: EngineConfig(max_waiting=-1),
    "EngineConfig(prefill_token_budget=0)": lambda: EngineConfig(prefill_token_budget=0),
    "EngineConfig(kv_disk=..., kv_disk_budget=0)": lambda: EngineConfig(kv_disk="/tmp/x", kv_disk_budget=0),
    "Request max_tokens=-1": lambda: list(run_alone(llm, Request("a", [1, 2], -1))),
    "Request ids as str": lambda: list(run_alone(llm, Request("a", "hello", 2))),
    "Request ids float": lambda: list(run_alone(llm, Request("a", [1.5, 2], 2))),
    "Request ids bool": lambda: list(run_alone(llm, Request("a", [True, 2], 2))),
    "Request ids tensor 2d": lambda: list(
        run_alone(llm, Request("a", torch.ones(2, 2, dtype=torch.long), 2))
    ),
    "Request id int": lambda: list(run_alone(llm, Request(5, [1, 2], 2))),
    "Request logprobs=-1": lambda: list(run_alone(llm, Request("a", [1, 2], 2, logprobs=-1))),
    "Request logprobs=10**9": lambda: list(run_alone(llm, Request("a", [1, 2], 2, logprobs=10**9))),
    "Request stop_ids=[1]": lambda: list(run_alone(llm, Request("a", [1, 2], 2, stop_ids=[1]))),
    "Request stop_ids={-1}": lambda: list(run_alone(llm, Request("a", [1, 2], 2, stop_ids=frozenset({-1})))),
    "Request sampling=None": lambda: list(run_alone(llm, Request("a", [1, 2], 2, sampling=None))),
    "SamplingParams(temperature=nan)": lambda: SamplingParams(temperature=float("nan")),
    "SamplingParams(top_p=0)": lambda: SamplingParams(top_p=0),
    "SamplingParams(top_k=-1)": lambda: SamplingParams(top_k=-1),
    "SamplingParams(seed=1.5)": lambda: SamplingParams(seed=1.5),
    "run_batch duplicate ids": lambda: run_batch(llm, [Request("a", [1, 2], 2), Request("a", [3, 4], 2)]),
    "run_batch not a list": lambda: run_batch(llm, Request("a", [1, 2], 2)),
    "generate_batch([])": lambda: llm.generate_batch([]),
    "generate_batch(['a', 3])": lambda: llm.generate_batch(["a", 3]),
    "generate('hi', max_new_tokens=0)": lambda: llm.generate("hi", 0),
    "generate('hi', -3)": lambda: llm.generate("hi", -3),
    "generate(b'hi')": lambda: llm.generate(b"hi"),
    "generate('hi', sampling='greedy')": lambda: llm.generate("hi", 2, sampling="greedy"),
    "generate_ids([], 2)": lambda: list(llm.generate_ids([], 2)),
    "generate_ids([1], 2, prefill_chunk=0)": lambda: list(llm.generate_ids([1], 2, prefill_chunk=0)),
    "generate_ids([1, 2, 3], 2, prefill_chunk=7)": lambda: list(
        llm.generate_ids([1, 2, 3], 2, prefill_chunk=7)
    ),
    "engine.abort(None)": lambda: eng().abort(None),
    "add_request(dict)": lambda: eng().add_request({"request_id": "a"}),
    "load(kv=None)": lambda: kvlens.load(d, kv=None),
    "load(kv=8)": lambda: kvlens.load(d, kv=8),
    "load(prefill_chunk=0)": lambda: kvlens.load(d, prefill_chunk=0),
    "load(device='tpu')": lambda: kvlens.load(d, device="tpu"),
    "load(attn_backend='x')": lambda: kvlens.load(d, attn_backend="x"),
}
for name, call in cases.items():
    try:
        print(f"OK          {name}: {str(call())[:70]}")
    except (ValueError, TypeError) as e:
        print(f"{type(e).__name__:12s}{name}: {str(e)[:110]}")
    except Exception as e:  # anything else is a finding
        print(f"!! {type(e).__name__} {name}: {str(e)[:110]}")
print(len(cases), "cases")
