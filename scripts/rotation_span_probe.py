"""Which rotation span suits 4-bit blocks? The q4 rule (llama.cpp's q4_0: one fp16 scale per 32
values) applied to K or to V after kvlens' randomized Hadamard rotation of span b (``rotation(d,
span=b)``: H_b on each contiguous block of b values, b = head_dim the whole row), against no rotation.

    python scripts/rotation_span_probe.py --model gemma3-270m --ctx 1024

The test sequence is the corpus's first ``--ctx`` tokens. Per layer: exact causal attention with f32
Q, K, V (sliding windows ignored) vs the same with K (or V) quantized and turned back; the figure is
the relative output error ``|o_hat - o|^2 / |o|^2`` summed over layers, and its ratio to plain q4's.
The result is docs/beyond-q8.md's "q4h rotates within each 32-value block".
"""

from __future__ import annotations

from k_smoothing_probe import causal_attention, corpus_ids, positive_int, probe_parser, q4_dequant

from kvlens.kv.quant import rotation


def span_rules(head_dim: int) -> dict:
    """Plain q4, then q4 after the rotation of each span from 4 to head_dim."""
    rules = {"q4 (no rotation)": lambda x: q4_dequant(x, True)}
    span = 4
    while span <= head_dim:
        r = rotation(head_dim, span=span)
        rules[f"q4 after span {span}"] = lambda x, r=r: q4_dequant(x @ r, True) @ r.T
        span *= 2
    return rules


def main() -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--ctx", type=positive_int, default=1024)
    args = ap.parse_args()
    try:
        llm, ids = corpus_ids(args.model, args.corpus, args.ctx)
        qkv = llm.capture_qkv(ids)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    rules = span_rules(qkv[0][1].shape[-1])
    print(f"{args.model}, {args.corpus}, {args.ctx} tokens: sum over layers of rel. error^2 (x plain q4)")
    for side in ("K", "V"):
        total = dict.fromkeys(rules, 0.0)
        for q, k, v in qkv:
            exact = causal_attention(q, k, v)
            for name, rule in rules.items():
                got = causal_attention(q, rule(k), v) if side == "K" else causal_attention(q, k, rule(v))
                total[name] += float((got - exact).norm() / exact.norm()) ** 2
        base = total["q4 (no rotation)"]
        for name, err in total.items():
            print(f"  {side} {name:18s} {err:.4g}  x{err / base:.3f}")


if __name__ == "__main__":
    main()
