"""What the prefix cache's reuse is keyed by, at the scheduler's side (``engine/prefix_cache.py``):
the model and the mirror's prefill source reach the salt of every block hash, the disk tier refuses a
file another model wrote under the same hash, and a prompt reuses every whole cached chunk that leaves
one token to compute (``kv/prefix.py``'s own salt test checks ``cache_salt`` alone)."""

from __future__ import annotations

import random

import pytest
from engine_loop import steps_until_done
from test_kv_disk import CHUNK as DISK_CHUNK
from test_kv_disk import _engine, _run, random_pool
from test_scheduler import budget, llm  # noqa: F401
from tiny_models import write_hf

import kvlens
from kvlens.engine.prefix_cache import PrefixCache
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.kv.cache import BLOCK
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool

CHUNK = 2 * BLOCK


def test_the_salt_names_the_model_and_the_mirrors_prefill_source():
    mode = KVMode.parse("q8+mirror")
    exact, q8 = (BlockPool(1, 1, 8, mode, 4 * BLOCK * 64, mirror_prefill=m) for m in ("exact", "q8"))
    salts = {
        PrefixCache(exact, "model-a", CHUNK).salt,
        PrefixCache(exact, "model-b", CHUNK).salt,
        PrefixCache(q8, "model-a", CHUNK).salt,
    }
    assert len(salts) == 3


def test_a_file_another_model_spilled_is_not_restored(tmp_path):
    """Two servers of other weights over one folder: even under the same hash (the salt differs, so
    this needs a forged hash), the file's header names its model and the other server refuses it."""
    pool_a, pool_b = random_pool("q8", 3), random_pool("q8", 4)
    a = PrefixCache(pool_a, "model-a", CHUNK, tmp_path, 1 << 20)
    h = bytes(range(32))
    a.disk.spill(1, h)
    assert a.disk.restore(2, h)  # the premise: the file is good for the model that wrote it
    b = PrefixCache(pool_b, "model-b", CHUNK, tmp_path, 1 << 20)
    assert h in b.disk  # it sees the file
    assert not b.disk.restore(1, h)


@pytest.mark.parametrize(
    ("whole_chunks", "extra", "reused_chunks"), [(2, 1, 2), (2, 0, 1), (1, 5, 1), (3, 1, 3)]
)
def test_a_prompt_reuses_every_cached_chunk_that_leaves_a_token_to_compute(
    llm,  # noqa: F811
    whole_chunks,
    extra,
    reused_chunks,
):
    """The first run publishes the prompt's whole chunks; the same prompt again reuses all of them if
    a token is left after them, else all but the last (its last token's logits must be computed)."""
    llm = llm.variant(prefill_chunk=CHUNK)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 16), prefix_cache=True))
    rng = random.Random(whole_chunks * 10 + extra)
    prompt = [rng.randrange(5, 300) for _ in range(whole_chunks * CHUNK + extra)]
    first = [
        Request("first", prompt, 1, stop_ids=frozenset()),
        Request("again", prompt, 1, stop_ids=frozenset()),
    ]
    cached = {}
    for r in first:
        engine.add_request(r)
        for _ in steps_until_done(engine, limit=100):
            for ev in engine.step():
                cached.setdefault(ev.request_id, ev.cached_tokens)
    assert cached == {"first": 0, "again": reused_chunks * CHUNK}


@pytest.mark.parametrize("other", ["weights", "model file"])
def test_a_restart_with_other_weights_over_the_same_folder_reuses_nothing(tmp_path, other):
    """A server restarted over the same ``--kv-disk`` folder with the same model file loaded with other
    weights (bf16 for f32), or with another file of the same shapes: the blocks on disk were computed
    by other weights, so the new server restores none of them and computes the prompt afresh."""
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    write_hf("llama", first_dir, seed=5)
    write_hf("llama", second_dir, seed=5 if other == "weights" else 6)
    rng = random.Random(11)
    history = [rng.randrange(3, 320) for _ in range(3 * DISK_CHUNK + 9)]
    first = kvlens.load(first_dir, kv="q8", attn_backend="numba", prefill_chunk=DISK_CHUNK, weights="f32")
    before = _engine(first, tmp_path / "tier", 8)
    _run(before, "turn1", history)
    _run(before, "filler", [rng.randrange(3, 320) for _ in range(7 * BLOCK)])
    assert before.prefix.disk.stats.spilled > 0  # the premise: the history's blocks are on disk
    weights = "bf16" if other == "weights" else "f32"
    second = kvlens.load(second_dir, kv="q8", attn_backend="numba", prefill_chunk=DISK_CHUNK, weights=weights)
    after = _engine(second, tmp_path / "tier", 8)
    events = _run(after, "turn2", history + [5, 6, 7])
    assert events[0].cached_tokens == 0 and after.prefix.disk.stats.restored == 0
