"""The paged pool's sink limit is one block inclusive: a mode that keeps exactly BLOCK sink positions
is served, and the first position past it is refused (test_sink_serving covers BLOCK + 1 alone)."""

import dataclasses

import pytest

import kvlens
from kvlens.engine.scheduler import Request, run_batch
from kvlens.kv.cache import BLOCK
from kvlens.kv.modes import MODES
from kvlens.kv.pool import BlockPool

TINY_MODEL = ("llama", 5)  # conftest's tiny_dir: head_dim 16


def test_a_sink_of_exactly_one_block_is_served(tiny_dir):
    mode = dataclasses.replace(MODES["q8"], keep_sink=BLOCK)
    pool = BlockPool(1, 1, 16, mode, 1 << 20)
    assert pool.sink == BLOCK
    llm = kvlens.load(tiny_dir, kv=mode)
    assert llm.servable
    prompt = list(range(3, 3 + BLOCK + 8))  # the sink full, and rows after it
    served = run_batch(llm, [Request("r", prompt, 4, stop_ids=frozenset())])["r"]
    # the served sequence (paged pool, its sink block) decodes what the contiguous cache decodes
    assert served == list(llm.generate_ids(prompt, 4, stop_at_eos=False))
    with pytest.raises(ValueError, match=f"at most {BLOCK}"):
        BlockPool(1, 1, 16, dataclasses.replace(mode, keep_sink=BLOCK + 1), 1 << 20)
