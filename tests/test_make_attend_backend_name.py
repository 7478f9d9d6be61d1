"""``make_attend`` (what the engine, the lab's sensitivity pass and the serving runner build their
attention from) refuses a backend name it does not know, rather than attending through torch."""

from __future__ import annotations

import pytest

from kvlens.engine.attention import BackendError, make_attend
from kvlens.kv.cache import KVCache
from kvlens.kv.modes import MODES


@pytest.mark.parametrize("name", ["TORCH", "torch ", "numba-int3", ""])
def test_an_unknown_backend_name_is_refused(name):
    cache = KVCache(2, 2, 32, 16, MODES["f32"])
    with pytest.raises(BackendError, match="backend"):
        make_attend(cache, True, name)


@pytest.mark.parametrize("name", ["torch", "numba", "numba-int"])
def test_a_known_name_builds(name):
    assert callable(make_attend(KVCache(2, 2, 32, 16, MODES["q8"]), False, name))
