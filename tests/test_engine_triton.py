"""The engine's Triton decode path (``attn_backend="triton"``: make_attend -> kernels.gpu) on tiny
random checkpoints: on the GPU where there is one, else under Triton's interpreter on the CPU.

The kernel tests (test_kernels.py and others) call the kernel directly; these run it where the engine
does: the cache write, the rotations of the h kinds, sliding windows and the split merge, inside a
model's forward pass. The reference is transformers in float64 (f32 cache) or float64 attention over
what the cache holds (quantized caches), with bounds.py's f32 worst cases.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from bounds import attention_bound, f32_forward_tol
from tiny_models import write_hf

import kvlens
from kvlens.engine.attention import make_attend
from kvlens.kernels.reference import attention_mask, reference_attention
from kvlens.kv.cache import rotations
from kvlens.kv.quant import rotation

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# One device per run: compiled for the GPU, or interpreted (conftest sets TRITON_INTERPRET=1 without CUDA).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IDS = [5, 17, 200, 33, 41, 9, 128, 77, 64, 3, 250, 199]
# head_dim 64 (SmolLM2's), two query heads per KV head: 4-bit blocks and the rotations apply
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module", params=["llama", "mistral-window"])
def tiny(request, tmp_path_factory):
    """(HF directory, transformers' float64 logits of IDS); Mistral with a window of 4."""
    root = tmp_path_factory.mktemp(request.param)
    window = 4 if request.param == "mistral-window" else None
    hf = write_hf(request.param.split("-")[0], root / "hf", sliding_window=window, **SHAPE)
    with torch.no_grad():
        ref = copy.deepcopy(hf).double()(torch.tensor([IDS])).logits[0]
    return root / "hf", ref


def test_triton_decode_equals_float64_hf(tiny):
    """Token by token through the Triton kernel over an f32 cache (the window read in place)."""
    hf_dir, ref = tiny
    llm = kvlens.load(hf_dir, kv="f32", device=DEVICE, attn_backend="triton")
    assert llm.attn_backend == "triton"
    cache = llm.new_cache(len(IDS))
    steps = [llm.model.logits(llm.forward([t], cache, i, prefill=i == 0)) for i, t in enumerate(IDS)]
    out = torch.cat(steps).double().cpu()
    assert (out - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)


@pytest.mark.parametrize("kv", ["f16", "bf16", "q8", "q8h", "q4", "q4h", "q6h", "k=q8h,v=q4h"])
def test_triton_attend_reads_what_the_cache_holds(tiny, kv):
    """One decode step after a 40-token prefill: every layer's attention through the Triton path and
    the torch path on the SAME cache (both write the same new row, then read), each against float64
    attention over the rows the cache holds (cache.read: dequantized, in the stores' basis)."""
    hf_dir, _ = tiny
    llm = kvlens.load(hf_dir, kv=kv, device=DEVICE, attn_backend="torch")
    ids = (IDS * 4)[:41]
    cache = llm.new_cache(len(ids))
    llm.prefill(ids[:-1], cache)
    windows = llm.config.layer_windows
    triton_attend = make_attend(cache, False, "triton", windows)
    torch_attend = make_attend(cache, False, "torch", windows)
    seen = []

    def attend(layer, q, k, v, start):
        outs = [f(layer, q, k, v, start) for f in (triton_attend, torch_attend)]
        end = start + 1
        kd, vd = cache.read(layer, end)
        mask = None
        if windows[layer] is not None:  # the query at end - 1 and its window, for every KV head
            q_pos = torch.tensor([end - 1], device=kd.device)
            mask = attention_mask(q_pos, end, windows[layer]).expand(kd.shape[0], end)
        ref, bound = reference_in_store_basis(
            q[:, 0], kd, vd, mask, rotations(cache.k[layer], cache.v[layer])
        )
        for out in outs:
            err = (out[:, 0].double() - ref).abs()
            assert (err <= bound).all(), (layer, (err / bound).max().item())
        seen.append(layer)
        return outs[0]

    with torch.inference_mode():
        llm.model.forward(torch.tensor([ids[-1]], device=llm.device), len(ids) - 1, attend)
    assert seen == list(range(llm.config.n_layers))


def reference_in_store_basis(q, kd, vd, mask, spans) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of ``q [H, d]`` over rows kept in the stores' basis (rotated kinds: ``x @ R``),
    returned in the model's basis, and its f32 bound (x2 headroom). Turning the output back by R.T can
    gather the rotated basis' errors: each output element by at most sqrt(span) times their max."""
    span_k, span_v = spans
    hd = q.shape[-1]
    q64 = q.double()
    if span_k:
        q64 = q64 @ rotation(hd, torch.float64, q.device, span=span_k)
    ref = reference_attention(q64[:, None], kd.double(), vd.double(), kv_mask=mask)[:, 0]
    bound = 2 * attention_bound(q64.float(), kd, vd, mask)
    if span_v:
        ref = ref @ rotation(hd, torch.float64, q.device, span=span_v).T
        bound = bound * span_v**0.5
    return ref, bound
