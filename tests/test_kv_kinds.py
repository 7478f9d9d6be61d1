"""Storage kinds' rules at their edges (kv/kinds.py), by hand: the row rule's code range at each width,
the head_dims a packed kind refuses, and q8's bytes per token where int8 K keeps code sums and where
it cannot (test_kv_bytes sums a real cache's tensors; this counts from the format's definition)."""

from __future__ import annotations

import pytest

from kvlens.kv.kinds import StoreKind, row_qmax
from kvlens.kv.modes import KVMode


def test_the_row_rule_stores_2_to_8_bits():
    """2^(bits-1) - 1 codes either side of zero from 2 to 8 bits (q8's 127); no rule outside that."""
    assert [row_qmax(b) for b in range(2, 9)] == [1, 3, 7, 15, 31, 63, 127]
    for bits in (0, 1, 9, 16):
        with pytest.raises(ValueError, match="2..8 bits"):
            row_qmax(bits)


@pytest.mark.parametrize("kind", [StoreKind.Q7H, StoreKind.Q6H, StoreKind.Q5H])
def test_a_packed_kind_needs_a_head_dim_of_whole_bytes(kind):
    """8 codes of N bits fill N bytes: head_dims 2 and 4 (powers of two, so the rotation would take
    them) are refused; 8 and 16 are stored."""
    for head_dim in (2, 4):
        with pytest.raises(ValueError, match="multiple of 8"):
            kind.check_head_dim(head_dim)
    for head_dim in (8, 16):
        kind.check_head_dim(head_dim)
        assert kind.row_bytes(head_dim) == head_dim * kind.bits // 8 + 2  # codes + fp16 max_abs


@pytest.mark.parametrize("head_dim", [32, 48, 64, 80, 96])
def test_q8_bytes_per_token_by_hand(head_dim):
    """q8: a byte per value and an fp32 max_abs per row, K and V; int8 K also one int16 code sum per
    32 codes, kept only where the row is whole blocks of 32 (the integer kernels' step)."""
    n_layers, n_kv = 3, 2
    ksum = 2 * (head_dim // 32) if head_dim % 32 == 0 else 0
    per_head = (head_dim + 4 + ksum) + (head_dim + 4)
    assert KVMode.parse("q8").bytes_per_token(n_layers, n_kv, head_dim) == n_layers * n_kv * per_head
