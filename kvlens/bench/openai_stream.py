"""The streamed request both serving benchmarks send (:mod:`.serve`, :mod:`.multiturn`): greedy,
``ignore_eos`` so every request produces exactly its output length, usage reported at the end."""

from __future__ import annotations

from typing import Any


async def open_stream(create: Any, model: str, output_len: int, **request: Any) -> Any:
    """``await create(...)`` (the openai client's ``completions.create`` or
    ``chat.completions.create``) for a stream of exactly ``output_len`` greedy tokens; ``request``:
    the prompt or messages."""
    return await create(
        model=model, max_tokens=output_len, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **request,
    )  # fmt: skip
