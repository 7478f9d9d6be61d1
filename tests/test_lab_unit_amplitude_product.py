"""``lab unit --amplitude``: each run scales --k-amp / --v-amp by a factor, so the product is what K
or V is multiplied by. Each alone within MAX_AMPLITUDE, the product past it (float32 K overflows) is
refused when the config is built, before any point runs; the product at the limit is taken."""

from __future__ import annotations

import pytest

from kvlens.lab.unit import MAX_AMPLITUDE, UnitConfig


@pytest.mark.parametrize("field", ["k_amp", "v_amp"])
def test_a_product_past_the_limit_is_refused_up_front(field):
    UnitConfig(**{field: 1e15}, amplitude=[1.0, MAX_AMPLITUDE / 1e15], seq_len=[16])
    with pytest.raises(ValueError, match=r"times each --amplitude\) must be > 0 and ≤ 1e\+30"):
        UnitConfig(**{field: 1e20}, amplitude=[1.0, 1e20], seq_len=[16])
