"""Generate in the parent, then in a child started by multiprocessing's "spawn": the way that works.

python spawn_child.py
"""

import multiprocessing as mp

import kvlens

PROMPT = "The capital of France is"


def child(prompt: str) -> str:
    return kvlens.load("smollm2", kv="q8").generate(prompt, max_new_tokens=4)


if __name__ == "__main__":
    m = kvlens.load("smollm2", kv="q8")
    print("parent:", repr(m.generate(PROMPT, max_new_tokens=4)), flush=True)
    with mp.get_context("spawn").Pool(1) as pool:
        print("spawned child:", repr(pool.apply(child, (PROMPT,))))
