"""One-off count behind docs/beyond-q8.md ("Gemma-3 at 8K: what 4-bit KV can save there"), session 10.
Output: step_bytes.out.

    .venv/bin/python docs/beyond-q8/q4search/attn-gemma-intel/step_bytes.py

Bytes a Gemma-3-270M decode step reads at 8K with --weights auto: the layers' weight matrices, the LM
head, and the K/V rows its attention reads (global layers: the whole context; windowed: the window)."""

import torch

import kvlens
from kvlens.kv.modes import KVMode

CTX = 8192
llm = kvlens.load("gemma3-270m", kv="q8", weights="auto")
w, c = llm.model.w, llm.config


def nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else x.nbytes


layers = sum(nbytes(getattr(L, m)) for L in w.layers for m in ("wqkv", "wo", "w_gate_up", "w_down"))
head = nbytes(w.lm_head)
n_global = sum(not c.is_windowed(i) for i in range(c.n_layers))
n_window = c.n_layers - n_global
print(f"layer weights {layers / 1e6:.1f} MB, LM head {head / 1e6:.1f} MB ({type(w.lm_head).__name__})")
print(
    f"{n_global} global layers x {CTX}, {n_window} windowed x {c.sliding_window}; {c.n_kv_heads} KV head(s), hd {c.head_dim}"
)
for name in ("q8", "q4h"):
    m = KVMode.parse(name)
    row = c.n_kv_heads * (
        m.k.row_bytes(c.head_dim) + m.v.row_bytes(c.head_dim)
    )  # K and V rows the kernel reads
    kv_global, kv_window = n_global * CTX * row, n_window * c.sliding_window * row
    total = layers + head + kv_global + kv_window
    print(
        f"{name}: KV global {kv_global / 1e6:.1f} MB, windowed {kv_window / 1e6:.1f} MB, "
        f"KV share {(kv_global + kv_window) / total:.1%} of {total / 1e6:.1f} MB"
    )
