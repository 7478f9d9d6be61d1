"""The tour's serving step: ``kvlens serve`` on a free loopback port, a few concurrent chat requests
through the ``openai`` client, what the q8 pool held versus f16, then a clean SIGTERM stop."""

from __future__ import annotations

import asyncio

from .process import ServerProcess

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "What is 7 times 8?",
    "Write one sentence about the sea.",
]
SERVER_ARGS = ["--kv", "q8", "--kv-budget", "64MiB", "--max-batch", "8"]
HEADER = f"kvlens serve {' '.join(SERVER_ARGS)}   ({len(QUESTIONS)} concurrent chat requests, openai client)"


async def _ask_all(url: str, model: str, max_tokens: int) -> list[str]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0
            )
            for q in QUESTIONS
        )
    )
    await client.close()
    return [r.choices[0].message.content for r in replies]


def serving_step(model: str = "smollm2", max_tokens: int = 32) -> None:
    from .cli import model_id

    with ServerProcess(["--model", model, *SERVER_ARGS]) as srv:
        print(srv.budget_line())
        answers = asyncio.run(_ask_all(srv.url, model_id(model), max_tokens))
        for q, a in zip(QUESTIONS, answers, strict=True):
            print(f"  > {q}\n    " + a.strip().replace("\n", "\n    "))
        m = srv.metrics()  # the engine's own high-water marks: exact, however short the burst
        tokens = int(m["kvlens_kv_blocks_used_peak"] * m["kvlens_kv_block_size"])
        q8_mib = tokens * m["kvlens_kv_bytes_per_token"] / 2**20
        f16_mib = q8_mib * m["kvlens_kv_tokens_capacity"] / m["kvlens_kv_f16_tokens_same_bytes"]
        print(
            f"at peak {int(m['kvlens_requests_running_peak'])} sequences ran at once in "
            f"{int(m['kvlens_kv_blocks_used_peak'])} blocks ({tokens} token positions): {q8_mib:.2f} MiB of "
            f"q8 KV, where f16 would take {f16_mib:.2f} MiB"
        )
        code = srv.stop()
        print(f"server stopped by SIGTERM, exit code {code}")
        if code != 0:
            raise RuntimeError(f"kvlens serve exited with {code}:\n{srv.output()}")
