"""Turn-2 TTFT of a two-turn chat against the real ``kvlens serve``, prefix cache on vs off, side
by side in one run (the official multi-turn load is ``kvlens bench serve --scenario multiturn``).

Each conversation: a system prompt holding a passage of the britannica corpus, a question, the
model's answer, a follow-up question. Turn 1 warms the cache; the figure is turn 2's time to first
token (streamed, client side), median over the conversations.

    python scripts/prefix_ttft.py --chunks 512,128 --conversations 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from kvlens.corpus import load_corpus
from kvlens.serve.process import ServerProcess


def ttft(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    first, text, cached = None, [], -1
    stream = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        # the first chunk (role, empty content) is sent on admission: wait for text or the finish
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return first, "".join(text), cached


def run(
    chunk: int, prefix: bool, passages: list[str], answer: int
) -> tuple[list[float], list[float], list[int]]:
    args = ["--kv", "q8", "--kv-budget", "256MiB", "--prefill-chunk", str(chunk)]
    turn1, turn2, cached = [], [], []
    with ServerProcess(args + ([] if prefix else ["--no-prefix-cache"]), start_timeout=300) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=600)
        for passage in passages:
            msgs = [{"role": "system", "content": f"Answer from this article.\n\n{passage}"},
                    {"role": "user", "content": "What is the article about?"}]  # fmt: skip
            t1, reply, _ = ttft(client, msgs, answer)
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
            t2, _, c = ttft(client, msgs, 1)
            turn1.append(t1)
            turn2.append(t2)
            cached.append(c)
    return turn1, turn2, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="512", help="comma list of --prefill-chunk values")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--chars", type=int, default=2600, help="passage length in characters")
    ap.add_argument("--answer", type=int, default=32, help="turn-1 answer tokens")
    a = ap.parse_args()
    text, _ = load_corpus(None)
    step = len(text) // (a.conversations + 1)
    passages = [text[i * step : i * step + a.chars] for i in range(1, a.conversations + 1)]
    print("| prefill chunk | prefix cache | turn-1 TTFT s | turn-2 TTFT s (median) | turn-2 cached tokens |")
    print("|---:|---|---:|---:|---:|")
    for chunk in [int(c) for c in a.chunks.split(",")]:
        medians = {}
        for prefix in (False, True):
            t1, t2, cached = run(chunk, prefix, passages, a.answer)
            medians[prefix] = statistics.median(t2)
            print(f"| {chunk} | {'on' if prefix else 'off'} | {statistics.median(t1):.2f} | "
                  f"{medians[prefix]:.2f} | {', '.join(map(str, cached))} |", flush=True)  # fmt: skip
        print(f"| {chunk} | on/off | | **{medians[True] / medians[False]:.2f}x** | |", flush=True)


if __name__ == "__main__":
    main()
