"""Batched decode rows where the forty-eighth session's mutation run found them unchecked: a Llama
and a Qwen2 (no sandwich norms; a QKV bias) through the torch glue that runs off the CPU, against
transformers in float64; and ``QLinear.decode_rows``, which reads the weights once for the whole
batch on the CPU and runs the rows one call each elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
from bounds import f32_forward_tol
from test_transformer_paths import decode_row_logits
from tiny_models import write_hf

import kvlens
from kvlens.models import qlinear
from kvlens.models.qlinear import BF16Linear, Int4Linear, Int8Linear


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rows_through_the_torch_glue_match_transformers(tmp_path, arch):
    """row_ops off (as on a GPU): the residual adds without sandwich norms (``_post_rows``), per row;
    Qwen2's QKV bias."""
    hf = write_hf(arch, tmp_path / arch)
    llm = kvlens.load(str(tmp_path / arch), kv="f32", weights="f32", attn_backend="torch")
    llm.model.row_ops = False
    seqs = [[5, 17, 200, 33, 41, 9, 128], [77, 64, 3, 250], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    with torch.no_grad():
        f64 = copy.deepcopy(hf).double()
        want = torch.stack([f64(torch.tensor([ids])).logits[0, -1] for ids in seqs])
    out = decode_row_logits(llm, seqs).double()
    assert (out - want).abs().max().item() <= f32_forward_tol(llm.config, want)


LAYERS = [Int8Linear, Int4Linear, BF16Linear]


def layer_and_rows(kind, rows: int = 4):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 70, generator=g)  # odd-sized k: the int4 kernel's padded pair too
    return kind.from_float(w), torch.randn(rows, 70, generator=g), torch.randn(96, generator=g)


@pytest.mark.parametrize("kind", LAYERS)
def test_cpu_decode_rows_read_the_weights_once_and_equal_one_row_calls(kind, monkeypatch):
    layer, x, bias = layer_and_rows(kind)
    alone = [layer(x[b : b + 1], bias) for b in range(x.shape[0])]
    calls = []
    run = qlinear._run
    monkeypatch.setattr(qlinear, "_run", lambda fn, work, *a: (calls.append(a[0].shape), run(fn, work, *a)))
    out = layer.decode_rows(x, bias)
    assert calls == [(4, 70)]  # one kernel call for the batch
    for b in range(x.shape[0]):
        assert torch.equal(out[b : b + 1], alone[b]), f"row {b}"


@pytest.mark.parametrize("kind", LAYERS)
def test_decode_rows_without_a_kernel_run_each_row_on_the_dequantized_weight(kind):
    """Off the CPU there are no kernel arrays (``_np`` None): each row is its own ``F.linear`` on the
    dequantized weight, with the bias."""
    layer, x, bias = layer_and_rows(kind, rows=3)
    layer._np = None
    w = layer.dequantize()
    out = layer.decode_rows(x, bias)
    assert out.shape == (3, 96)
    for b in range(3):
        assert torch.equal(out[b], torch.nn.functional.linear(x[b : b + 1], w, bias)[0])
    # against float64: k products and sums in f32, each rounding within 2^-24 of its running magnitude
    bound = (x.shape[1] + 1) * 2**-24 * (x.abs().double() @ w.abs().double().T + bias.abs().double())
    assert ((out.double() - (x.double() @ w.double().T + bias.double())).abs() <= bound).all()


def test_linear_rows_without_the_f32_kernel_run_each_row_alone():
    """A float weight the f32 row kernel does not take (not f32 on the CPU: a GPU's f16, here float64)
    runs one ``F.linear`` a row: the bias added, each row the same bits as a batch of one."""
    g = torch.Generator().manual_seed(2)
    x, w, bias = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 5), (4, 5), (4,)))
    out = qlinear.linear_rows(x, w, bias)
    assert out.shape == (3, 4)
    assert (out - (torch.einsum("bk,nk->bn", x, w) + bias)).abs().max().item() < 1e-12
    for b in range(3):
        assert torch.equal(out[b : b + 1], qlinear.linear_rows(x[b : b + 1], w, bias))
