"""K smoothing (a recipe's ``k_center``): every K row less one fixed vector per (layer, KV head),
before rotation and quantization, in every store a key reaches; attention unchanged in exact
arithmetic (softmax ignores the shift ``q·c`` every score of a query gets).

Expected values come from float64 references that subtract the centers, quantize each row by
independent transcriptions of the rules (llama.cpp's q4_0 from test_kv_rotated_q4, the q8 rule from
test_q8_cache) and attend in float64; the fused decode step is held bit for bit to the general path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_decode_step import Spy, assert_same_steps
from test_kv_q4_search import searched_reference
from test_kv_rotated_q4 import q4_0_reference
from test_q8_cache import rule
from test_recipe_heads import engine_logits, paged_and_contiguous
from tiny_models import write_hf

import kvlens
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import KVCache
from kvlens.kv.modes import MODES, CacheOptions, StoreKind
from kvlens.kv.prefix import cache_salt
from kvlens.kv.quant import rotate_rows, rotation
from kvlens.kv.recipe import head_recipe_mode, with_k_center
from kvlens.lab.layers import stored_kv

F16, F32, Q8, Q8H, Q4, Q4H = (StoreKind(x) for x in ("f16", "f32", "q8", "q8h", "q4", "q4h"))
HD = 32
LAYERWISE = [[(Q4H, Q8)] * 2, [(F16, Q4H)] * 2]  # the fused step runs these (no per-head split)
PER_HEAD = [[(Q4H, Q8), (F16, Q4H)], [(Q8H, F16), (Q4, Q8H)]]  # f16 K beside q4h K in layer 0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A Llama (fused decode step) with head_dim 32: 2 layers, 4 query heads on 2 KV heads."""
    out = tmp_path_factory.mktemp("ksmooth") / "hf"
    write_hf("llama", out, seed=5, hidden_size=128)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return kvlens.load(tiny_dir, kv="f32", attn_backend="torch")


IDS = list(range(5, 46))


@pytest.fixture(scope="module")
def center(tiny) -> torch.Tensor:
    """The mean captured key per (layer, KV head) plus an offset of twice the keys' spread: far from
    zero, so the stored codes differ clearly with and without it."""
    keys = torch.stack([k for _, k, _ in tiny.capture_qkv(IDS)])  # [L, KV, n, d]
    g = torch.Generator().manual_seed(3)
    return keys.mean(2) + 2 * keys.std() * torch.randn(keys.shape[0], keys.shape[1], HD, generator=g)


def stored64(kind: StoreKind, rows: torch.Tensor) -> torch.Tensor:
    """``rows [n, d]`` (float64, centers already off) as a store of ``kind`` gives them back, in the
    model's basis: rotated (float64 R), quantized by the transcribed rule, dequantized, rotated back."""
    r = rotation(rows.shape[-1], torch.float64, span=kind.rotation_span(rows.shape[-1]) or None)
    x = (rows @ r if kind.rotated else rows).float().numpy()
    if kind.int8:
        out = np.array([np.array(c, np.float64) * (m / 127.0) for c, m in (rule(list(row)) for row in x)])
    elif kind.int4:
        codes, bits = (searched_reference if kind.scale_search else q4_0_reference)(x)
        scale = np.repeat(bits.view(np.float16).astype(np.float64), 32, axis=-1)
        out = (codes - 8) * scale
    else:
        out = x.astype(np.dtype(str(kind.dtype).removeprefix("torch."))).astype(np.float64)
    y = torch.from_numpy(out)
    return y @ r.T if kind.rotated else y


def reference_logits(llm, ids: list[int], heads, c: torch.Tensor | None) -> torch.Tensor:
    """Each head's K less its center, each row stored by its kind's rule, attention in float64."""

    def attend(layer, q, k, v, start):
        ck = torch.zeros(k.shape[0], HD, dtype=torch.float64) if c is None else c[layer].double()
        kq = torch.stack([stored64(kk, k[h].double() - ck[h]) for h, (kk, _) in enumerate(heads[layer])])
        vq = torch.stack([stored64(vk, v[h].double()) for h, (_, vk) in enumerate(heads[layer])])
        return reference_attention(q.double(), kq, vq, torch.arange(start, start + q.shape[1])).float()

    with torch.inference_mode():
        return llm.model.logits(llm.model.forward(torch.tensor(ids), 0, attend))


# ------------------------------------------------------------------ (a) invariance without quantization


def test_centered_f32_recipe_keeps_the_logits(tiny, center):
    mode = with_k_center(head_recipe_mode("f32c", [[(F32, F32)] * 2] * 2), center)
    got, ref = tiny.logits(IDS, kv=mode), tiny.logits(IDS, kv="f32")
    # only f32 rounding moves: k - c rounds to half an ulp of |k| + |c| (measured ~3 ulp of the
    # largest logit); a center applied to some positions and not others moves logits by O(1)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert not torch.equal(got, ref)  # the centers were applied: rounding differs somewhere


def test_rotation_and_centering_leave_scores_and_outputs_unchanged_in_float64():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 20, 64, generator=g, dtype=torch.float64) for _ in range(3))
    c = 5 * torch.randn(2, 1, 64, generator=g, dtype=torch.float64)
    r = rotation(64, torch.float64)
    pos = torch.arange(20)
    ref = reference_attention(q, k, v, pos)
    got = reference_attention(q @ r, (k - c) @ r, v, pos)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    # the score differences (what softmax reads) are unchanged; the scores themselves move by q·c
    s, s_c = q @ k.transpose(1, 2), (q @ r) @ ((k - c) @ r).transpose(1, 2)
    assert torch.allclose(s - s_c, (q @ c.transpose(1, 2)).expand_as(s), atol=1e-10)


# ------------------------------------------------------------------ (b) quantized, vs float64


@pytest.mark.parametrize(
    "backend,heads", [("torch", LAYERWISE), ("numba", LAYERWISE), ("torch", PER_HEAD), ("numba", PER_HEAD)]
)
def test_centered_recipe_logits_match_a_float64_reference(tiny, center, backend, heads):
    mode = with_k_center(head_recipe_mode("c", heads), center)
    llm = tiny.variant(kv=mode, attn_backend=backend)
    spy = Spy(llm) if backend == "numba" else None
    got = engine_logits(llm, IDS)
    if spy is not None:  # a layer-wise recipe's decode step ran the fused step, centers and all
        assert spy.calls == (1 if heads is LAYERWISE else 0)
    ref = reference_logits(tiny, IDS, heads, center)
    err = (got - ref).abs().max()
    # f32 engine vs f64 reference on the same codes: f32 rounding only (logits ~O(1))
    assert err < 2e-3 * ref.abs().max(), err
    # the centers matter: the same kinds without them store other codes
    plain = engine_logits(tiny.variant(kv=head_recipe_mode("p", heads), attn_backend=backend), IDS)
    assert (plain - ref).abs().max() > 20 * err
    assert (plain - reference_logits(tiny, IDS, heads, None)).abs().max() < 2e-3 * ref.abs().max()


# ------------------------------------------------------------------ (c) the fused step, bit for bit


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend", ["numba", "numba-int16"])
def test_fused_step_with_centers_is_bit_identical_to_the_general_path(tiny_dir, center, backend):
    heads = LAYERWISE if backend == "numba" else [[(Q8H, Q4H)] * 2, [(Q8, F16)] * 2]  # int16: int8 K only
    mode = with_k_center(head_recipe_mode("c", heads), center)
    llm = kvlens.load(tiny_dir, kv=mode, attn_backend=backend)
    assert_same_steps(llm, IDS, mode)  # logits and every store's codes, scales and sums


# ------------------------------------------------------------------ stores, identity


def test_every_store_a_key_reaches_holds_k_less_its_center(center):
    g = torch.Generator().manual_seed(1)
    k, v = 3 * torch.randn(2, 40, HD, generator=g), torch.randn(2, 40, HD, generator=g)
    c = center[0].unsqueeze(1)  # layer 0's, [KV, 1, d]
    per_head = with_k_center(head_recipe_mode("h", [[(F16, F32), (Q8H, F32)], [(F32, F32)] * 2]), center)
    cache = KVCache(2, 2, HD, 40, per_head, options=CacheOptions(keep_recent=8))
    cache.write(0, 0, k, v)
    f16_head = cache.k[0].parts[0]
    assert torch.equal(f16_head.data[:, :40], (k[:1] - c[:1]).half())  # the f16 head of a mixed layer
    exact = cache.k_exact[0].read(0, 40)  # the kept-exact copy, in each head's stored basis
    assert torch.equal(exact[0], k[0] - c[0]) and torch.equal(exact[1], rotate_rows(k[1:] - c[1:])[0])
    mirror = KVCache(2, 2, HD, 40, with_k_center(MODES["q8+mirror"], center))
    mirror.write(0, 0, k, v)
    assert torch.equal(mirror.k_exact[0].read(0, 40), k - c)
    assert torch.equal(mirror.v_exact[0].read(0, 40), v)  # V is never shifted


def test_a_centered_mode_is_not_the_uncentered_one(center):
    plain = head_recipe_mode("r", LAYERWISE)
    mode, other = with_k_center(plain, center), with_k_center(plain, center + 1)
    assert mode != plain and mode != other and mode == with_k_center(plain, center.clone())
    assert len({plain, mode, other}) == 3
    assert plain.identity == "r" and mode.identity.startswith("r|k_center=")
    salts = {cache_salt("m", m, "exact", 32) for m in (plain, mode, other)}
    assert len(salts) == 3  # prefix-cache (and disk-tier) blocks are never shared across them


# ------------------------------------------------------------------ (d) paged pool


@pytest.mark.parametrize("heads", [LAYERWISE, PER_HEAD])
def test_paged_pool_with_centers_is_the_contiguous_cache_bit_for_bit(tiny, center, heads):
    mode = with_k_center(head_recipe_mode("h", heads), center)
    llm = tiny.variant(kv=mode, attn_backend="numba")
    pool, paged, contiguous, out = paged_and_contiguous(llm, mode, IDS, HD)
    assert torch.equal(out[0], out[1])
    rows = [t[:, : len(IDS) % 32] for t in pool.block_rows(paged.blocks[1])]
    ref = contiguous.k[0].data if heads is LAYERWISE else contiguous.k[0].parts[0].data
    assert torch.equal(rows[0], ref[:, 32 : len(IDS)])  # layer 0's K codes, block 1


def test_lab_layers_sees_stored_rows_in_the_models_basis(tiny, center):
    """``lab layers`` attends what a cache stored: rotated kinds turned back (they were read in the
    rotated basis: relative error ~1.3), centers left off (attention ignores them)."""
    qkv = tiny.capture_qkv(IDS)
    pos = torch.arange(len(IDS))
    centered = with_k_center(head_recipe_mode("c", [[(Q8H, Q8H)] * 2] * 2), center)
    for mode in (MODES["q8h"], centered):
        for (q, k, v), (kq, vq) in zip(qkv, stored_kv(tiny, qkv, mode), strict=True):
            ref = reference_attention(q.double(), k.double(), v.double(), pos)
            got = reference_attention(q.double(), kq.double(), vq.double(), pos)
            assert (got - ref).norm() < 0.05 * ref.norm()  # 8-bit steps (|k - c| ~ 3 |k| here)
