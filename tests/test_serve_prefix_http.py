"""The prefix cache and its disk tier through the real server (SmolLM2, q8) and the real ``openai``
client: a second chat turn reports ``usage.prompt_tokens_details.cached_tokens``, the metrics count
it, evicted blocks go to disk and come back, and every answer re-runs alone (no cache) to the same
ids (``verify_record``): reuse changes nothing but the time."""

from __future__ import annotations

import openai
import pytest

from kvlens.serve.process import ServerProcess

pytestmark = pytest.mark.slow

CHUNK = 64  # the reuse unit (prefill chunk) of this server
SYSTEM = (
    "You are a careful assistant for a museum of natural history. Answer questions about the "
    "exhibits in two sentences, name the hall where each exhibit stands, and never invent dates. "
    "The halls are: the Hall of Minerals, the Hall of Oceans, the Hall of Early Mammals, the Hall of "
    "Birds of the World, and the Hall of Meteorites, which holds a large iron meteorite."
)


@pytest.fixture(scope="module")
def server(smol_path, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kvdisk")
    srv = ServerProcess(
        ["--model", str(smol_path), "--kv", "q8", "--weights", "f32", "--kv-budget", "6MiB",
         "--prefill-chunk", str(CHUNK), "--kv-disk", str(disk), "--kv-disk-budget", "64MiB",
         "--max-batch", "2"],
        start_timeout=420,  # a cold cache: the warm-up compiles the kernels first
    )  # fmt: skip
    yield srv, disk
    code, output = srv.stop(), srv.output()
    srv.close()
    assert code == 0, output


@pytest.fixture(scope="module")
def ref(smol_loaded):
    import kvlens

    return kvlens.LLM(smol_loaded, kv="q8", prefill_chunk=CHUNK)


def _chat(client, model: str, messages: list[dict]):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)


def _verified(ref, r) -> None:
    from kvlens.engine.verify import verify_record

    result = verify_record(ref, r.model_extra["kvlens"])
    assert result.ok and not result.mismatched, result.message


def test_second_turn_is_served_from_the_cache_then_from_disk(server, ref, smol_path):
    srv, disk = server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
    model = smol_path.stem
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the meteorite?"}]
    r1 = _chat(client, model, turn1)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And the whales?"}]  # fmt: skip
    r2 = _chat(client, model, turn2)
    want = r1.usage.prompt_tokens // CHUNK * CHUNK  # turn 1's whole chunks
    assert want >= CHUNK and r2.usage.prompt_tokens_details.cached_tokens == want
    _verified(ref, r2)
    m = srv.metrics()
    assert m["kvlens_prefix_hit_tokens_total"] == want
    assert m["kvlens_prompt_tokens_total"] == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    # turn 2 again, streamed: now its own whole chunks are cached too (all but its last token's chunk)
    chunks = list(client.chat.completions.create(
        model=model, messages=turn2, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == r2.choices[0].message.content
    )
    again = (r2.usage.prompt_tokens - 1) // CHUNK * CHUNK
    assert again >= want and chunks[-1].usage.prompt_tokens_details.cached_tokens == again

    # two long conversations fill the 6 MiB pool (16 blocks of 32): turn 2's blocks go to disk
    for topic in ("minerals and crystals", "early mammals"):
        _chat(client, model, [{"role": "user", "content": f"Tell me about {topic}. " * 55}])
    m = srv.metrics()
    assert m["kvlens_kv_disk_blocks_spilled_total"] > 0 and m["kvlens_kv_disk_bytes"] > 0
    assert list(disk.glob("*.kvb"))
    turn3 = [*turn2, {"role": "assistant", "content": r2.choices[0].message.content},
             {"role": "user", "content": "Thanks."}]  # fmt: skip
    r3 = _chat(client, model, turn3)
    m = srv.metrics()
    assert m["kvlens_kv_disk_blocks_restored_total"] > 0 and m["kvlens_kv_disk_restore_seconds_count"] > 0
    assert r3.usage.prompt_tokens_details.cached_tokens >= want
    assert m["kvlens_kv_disk_corrupt_blocks_total"] == 0 and m["kvlens_prefix_evictions_total"] > 0
    assert m["kvlens_kv_disk_spill_failures_total"] == 0
    _verified(ref, r3)
