"""``kvlens serve``'s start-up helpers (serve/cli.py) by hand: the model id clients send, the budget
line's ratio, the prefix line, every option reaching the engine config, and a socket that could not
be bound closed, not leaked."""

from __future__ import annotations

import gc
import socket
import warnings
from types import SimpleNamespace

import pytest

from kvlens.engine.serving import EngineConfig
from kvlens.serve.cli import ServeConfig, budget_summary, listen_socket, model_id, prefix_summary


def test_the_model_id_is_the_file_stem_the_folder_name_or_the_name(tmp_path):
    (tmp_path / "tiny-q8.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf-model").mkdir()
    assert model_id(str(tmp_path / "tiny-q8.gguf")) == "tiny-q8"
    assert model_id(str(tmp_path / "hf-model")) == "hf-model"
    assert model_id("smollm2") == "smollm2"


def test_the_budget_line_says_how_many_times_f16_the_pool_holds():
    stats = SimpleNamespace(
        blocks_total=10, block_size=32, tokens_capacity=320, bytes_per_token=100, f16_tokens_same_bytes=160
    )
    line = budget_summary(stats, "q8")
    assert line == (
        "KV pool (q8): 10 blocks x 32 positions = 320 tokens at 100 B/token; "
        "f16 would hold 160 tokens in the same bytes (x2.00)"
    )


def test_a_port_in_use_is_refused_and_the_socket_closed():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            try:
                listen_socket("127.0.0.1", port)
            except ValueError as e:
                assert f"cannot listen on 127.0.0.1:{port}" in str(e)
            else:
                pytest.fail("a port in use was bound")
            gc.collect()  # an unclosed socket warns when it is collected
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    finally:
        taken.close()


def test_every_serve_option_reaches_the_engine_config(tmp_path):
    config = ServeConfig(
        kv_budget="1MiB", max_batch=3, max_waiting=5, kv_disk=str(tmp_path), kv_disk_budget="2MiB"
    )
    assert config.engine_config() == EngineConfig(
        kv_budget_bytes=1 << 20, max_batch=3, max_waiting=5, prefix_cache=True, kv_disk=str(tmp_path),
        kv_disk_budget=2 << 20,
    )  # fmt: skip


def test_the_prefix_line_names_the_chunk_and_the_disk_tier():
    assert (
        prefix_summary(ServeConfig(prefill_chunk=256))
        == "prefix cache: on (reuse in whole chunks of 256 tokens)"
    )
    assert prefix_summary(ServeConfig(prefill_chunk=64, kv_disk="/d", kv_disk_budget="2GiB")) == (
        "prefix cache: on (reuse in whole chunks of 64 tokens); disk tier /d (2GiB)"
    )
    assert prefix_summary(ServeConfig(prefix_cache=False)) == "prefix cache: off"
