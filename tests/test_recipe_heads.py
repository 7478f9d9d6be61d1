"""Per-KV-head recipes: JSON round trip into the engine, logits against a float64 reference that
quantizes each head with its own kind, refusals (head count, unknown kind, the paged pool)."""

from __future__ import annotations

import json

import pytest
import torch

import kvlens
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import HeadSplitStore, RowStore
from kvlens.kv.modes import KVMode, StoreKind
from kvlens.kv.pool import BlockPool, PagedKV
from kvlens.kv.quant import rotation
from kvlens.kv.recipe import RecipeError, head_recipe_mode, load_recipe, mix, save_recipe

F16, F32, Q8, Q8H, Q4, Q4H = (StoreKind(x) for x in ("f16", "f32", "q8", "q8h", "q4", "q4h"))
# layer 0: heads differ in K and V; layer 1: one pair for both heads
HEADS = [[(Q4H, Q8), (Q8, Q4H)], [(Q4H, Q4H), (Q4H, Q4H)]]  # one head rotated, one not


TINY_MODEL = ("qwen3", 5)  # conftest's tiny_dir / tiny: 2 layers, 2 KV heads, head_dim 32


def write(path, layers):
    path.write_text(json.dumps({"kvlens_recipe": 1, "layers": layers}))
    return str(path)


def test_round_trip_json_engine(tmp_path, tiny):
    mode = head_recipe_mode("r", HEADS)
    path = tmp_path / "r.json"
    save_recipe(mode, 2, path)
    data = json.loads(path.read_text())
    assert data["layers"] == [{"k": ["q4h", "q8"], "v": ["q8", "q4h"]}, {"k": "q4h", "v": "q4h"}]
    back = load_recipe(path)
    assert back.heads == mode.heads and back.layers == mode.layers and back.per_head
    cache = tiny.variant(kv=str(path)).new_cache(40)
    assert isinstance(cache.k[0], HeadSplitStore) and isinstance(cache.k[1], RowStore)
    got = [[(ks.kind, vs.kind) for ks, vs in zip(cache.k[0].parts, cache.v[0].parts, strict=True)]]
    assert got == [HEADS[0]] and (cache.k[1].kind, cache.v[1].kind) == (Q4H, Q4H)
    hd = 32  # bytes: every head's own rows, summed
    expected = sum(k.row_bytes(hd, with_ksum=True) + v.row_bytes(hd) for layer in HEADS for k, v in layer)
    assert cache.bytes_per_token() == expected == back.bytes_per_token(2, 2, hd)


def test_a_role_whose_heads_agree_is_written_as_one_kind(tmp_path):
    """The file format (kv.recipe's docstring): a role lists one kind per KV head only where the heads
    differ; a single kind applies to every head."""
    mode = head_recipe_mode("r", [[(Q4H, Q8), (Q8, Q8)], [(Q8, Q4H), (Q8, Q8)]])
    path = tmp_path / "r.json"
    save_recipe(mode, 2, path)
    assert json.loads(path.read_text())["layers"] == [
        {"k": ["q4h", "q8"], "v": "q8"},
        {"k": "q8", "v": ["q4h", "q8"]},
    ]
    assert load_recipe(path).heads == mode.heads


def test_mix_counts_layer_and_kv_head_pairs():
    """By hand: 3 KV heads; a layer-wide pair counts once per head, a per-head layer per its heads."""
    per_layer = head_recipe_mode("r", [[(Q8H, Q8H)] * 3, [(Q8H, Q4H)] * 3, [(Q8H, Q8H)] * 3])
    assert mix(per_layer, 3, 3) == "6x K q8h / V q8h, 3x K q8h / V q4h"
    per_head = head_recipe_mode("r", [[(Q8H, Q8H), (Q4H, Q4H), (Q4H, Q4H)], [(Q8H, Q8H)] * 3])
    assert mix(per_head, 2, 3) == "4x K q8h / V q8h, 2x K q4h / V q4h"


def stored_values(kind: StoreKind, rows: torch.Tensor) -> torch.Tensor:
    """``rows [n, d]`` quantized by ``kind`` and turned back to the model's basis, float64."""
    d = rows.shape[-1]
    rot = rotation(d, torch.float64, rows.device, kind.rotation_span(d)) if kind.rotated else None
    x = rows.double() if rot is None else rows.double() @ rot
    store = RowStore.empty(kind, 1, rows.shape[0], d, rows.device)
    store.write(0, x.float()[None])
    out = store.read(0, rows.shape[0])[0].double()
    return out if rot is None else out @ rot.T


def reference_logits(llm, ids: list[int], heads) -> torch.Tensor:
    """Every head's K and V quantized by its own kind, attention in float64 (one causal pass)."""

    def attend(layer, q, k, v, start):
        kq = torch.stack([stored_values(kk, k[h]) for h, (kk, _) in enumerate(heads[layer])])
        vq = torch.stack([stored_values(vk, v[h]) for h, (_, vk) in enumerate(heads[layer])])
        pos = torch.arange(start, start + q.shape[1])
        return reference_attention(q.double(), kq, vq, pos).float()

    model = llm.model
    with torch.inference_mode():
        return model.logits(model.forward(torch.tensor(ids), 0, attend))


def engine_logits(llm, ids: list[int]) -> torch.Tensor:
    """Prefill of all but the last token, then one decode step (the fused step where it applies)."""
    cache = llm.new_cache(len(ids))
    with torch.inference_mode():
        prefill = llm.model.logits(llm.forward(ids[:-1], cache, 0, prefill=True))
        last = llm.lm_head(llm.forward(ids[-1:], cache, len(ids) - 1, prefill=False))
    return torch.cat([prefill, last])


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_per_head_logits_match_a_per_head_reference(tmp_path, tiny, backend):
    path = write(tmp_path / "h.json", [{"k": ["q4h", "q8"], "v": ["q8", "q4h"]}, {"k": "q4h", "v": "q4h"}])
    ids = list(range(5, 46))
    ref = reference_logits(tiny, ids, HEADS)
    llm = tiny.variant(kv=path, attn_backend=backend)
    got = engine_logits(llm, ids)
    # f32 engine vs f64 reference on the same quantized values: f32 rounding only (logits ~O(10))
    assert (got - ref).abs().max() < 2e-3 * ref.abs().max()
    # and the heads' kinds matter: the uniform mode of layer 1's pair differs by far more
    other = tiny.logits(ids, kv="q4h")
    assert (other - ref).abs().max() > 20 * (got - ref).abs().max()


@pytest.mark.parametrize(
    "layers,match",
    [
        ([{"k": ["q8", "q3"], "v": "q8"}] * 2, "layer 0 K head 1: unknown KV kind 'q3'"),
        ([{"k": ["q8", "q8"], "v": ["q8"]}] * 2, "K and V list different numbers of KV heads"),
        ([{"k": [], "v": "q8"}] * 2, "different numbers of KV heads \\(or none\\)"),
    ],
)
def test_bad_per_head_recipe_is_one_clear_error(tmp_path, layers, match):
    with pytest.raises(RecipeError, match=match):
        KVMode.parse(write(tmp_path / "bad.json", layers))


def test_wrong_head_count_is_refused(tmp_path, tiny, tiny_dir):
    three = write(tmp_path / "three.json", [{"k": ["q8", "q8", "q4"], "v": "q8"}] * 2)
    msg = "gives layer 0 kinds for 3 KV heads; the model has 2"
    with pytest.raises(ValueError, match=msg):
        tiny.variant(kv=three)
    with pytest.raises(ValueError, match=msg):
        kvlens.load(tiny_dir, kv=three)


def paged_and_contiguous(llm, mode: KVMode, ids: list[int], head_dim: int) -> tuple:
    """(pool, paged view, contiguous cache, [paged logits, contiguous logits]): ``ids`` prefilled but
    the last, which is decoded, through a 2-layer, 2-KV-head serving pool (the sequence's blocks not
    the first ones, so the block table matters) and through the contiguous cache."""
    pool = BlockPool(2, 2, head_dim, mode, 1 << 20)
    pool.allocate(1)
    paged, contiguous = PagedKV(pool), llm.new_cache(len(ids))
    paged.grow(len(ids))
    out = []
    for cache in (paged, contiguous):
        with torch.inference_mode():
            llm.forward(ids[:-1], cache, 0, prefill=True)
            out.append(llm.lm_head(llm.forward(ids[-1:], cache, len(ids) - 1, prefill=False)))
    return pool, paged, contiguous, out


def test_paged_pool_runs_a_per_head_recipe_like_the_contiguous_cache(tiny):
    """The serving pool (block table, fused kernel per head through the table) computes what the
    contiguous cache computes, and its disk-tier block view holds every head's tensors."""
    mode = head_recipe_mode("h", HEADS)
    llm = tiny.variant(kv=mode, attn_backend="numba")
    pool, _paged, _contiguous, out = paged_and_contiguous(llm, mode, list(range(5, 46)), 32)
    assert torch.equal(out[0], out[1])
    # layer 0, per head: K q4h codes+scales, K q8 codes+scales+sums, V q8 codes+scales, V q4h
    # codes+scales; layer 1 (not split): K and V q4h codes+scales of both heads at once
    assert len(pool.block_rows(0)) == (2 + 3 + 2 + 2) + (2 + 2)
