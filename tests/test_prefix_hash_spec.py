"""The prefix cache's block names, against their definition computed here with hashlib and struct
(not through kvlens): a disk tier keeps these names across processes, so they must not drift."""

import hashlib
import struct

import pytest

from kvlens.kv.prefix import block_hashes
from kvlens.kv.stores import BLOCK


def spec_hashes(tokens: list[int], n_blocks: int, salt: bytes) -> list[bytes]:
    h, out = hashlib.sha256(salt).digest(), []
    for j in range(n_blocks):
        block = tokens[j * BLOCK : (j + 1) * BLOCK]
        h = hashlib.sha256(h + struct.pack(f"<{BLOCK}i", *block)).digest()
        out.append(h)
    return out


@pytest.mark.parametrize("n_tokens, n_blocks", [(0, 0), (BLOCK, 1), (3 * BLOCK + 5, 3), (3 * BLOCK + 5, 1)])
def test_the_chained_hash_is_sha256_over_little_endian_int32_ids(n_tokens, n_blocks):
    tokens = [(7919 * i + 13) % (2**31) for i in range(n_tokens)]  # ids up to 2**31 - 1: all four bytes used
    tokens[-1:] = [2**31 - 1] if tokens else []
    salt = b"kvlens-prefix-v1|digest|q8|exact|chunk=64"
    assert block_hashes(tokens, n_blocks, salt) == spec_hashes(tokens, n_blocks, salt)


def test_a_block_count_past_the_tokens_is_refused():
    tokens = list(range(2 * BLOCK - 1))  # one position short of two full blocks
    assert len(block_hashes(tokens, 1, b"s")) == 1
    with pytest.raises(ValueError, match=f"{2 * BLOCK - 1} tokens hold no 2 full blocks"):
        block_hashes(tokens, 2, b"s")


@pytest.mark.parametrize("bad", [2**31, -1])
def test_an_id_that_int32_cannot_hold_is_refused(bad):
    tokens = [5] * (BLOCK - 1) + [bad]
    with pytest.raises(ValueError, match="token id"):
        block_hashes(tokens, 1, b"s")
