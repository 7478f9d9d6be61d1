"""``Tokenizer.encode`` lets other Python threads run while it works: the server tokenizes a prompt in
a worker thread, and a long one (seconds) must not stop the event loop meanwhile. The tokenizers
library's ``encode`` holds the GIL throughout; ``encode_batch`` releases it. Checked by counting what
the main thread gets done while a long text is encoded: nothing at all with the GIL held."""

from __future__ import annotations

import threading
import time

from test_tokenizer import gguf_path, meta, tok  # noqa: F401 - fixtures: the SmolLM2 GGUF tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB, ~0.4 M tokens


def test_encode_lets_other_threads_run(tok):  # noqa: F811
    inside, ids = threading.Event(), []

    def work() -> None:
        inside.set()
        ids.extend(tok.encode(TEXT, add_bos=False))

    worker = threading.Thread(target=work)
    worker.start()
    inside.wait()
    ticks = 0
    while worker.is_alive():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    assert len(ids) > 100_000  # the premise: real work, far longer than a few 1 ms sleeps
    assert ticks >= 20, f"the main thread ran {ticks} times while encode worked"
