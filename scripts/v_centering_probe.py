"""Would centering V help as centering K did? A probe of "V centering": subtract one fixed vector c
from every cached value row of a (layer, KV head) and add it back to the attention output. Exact
in exact arithmetic, since each query's softmax weights sum to 1 (``softmax(s) @ (v - c) + c =
softmax(s) @ v``), so only the quantization error changes. Not a cache mode of kvlens (see
docs/beyond-q8.md, "V centering: probed, not built").

    python scripts/v_centering_probe.py --model smollm2 --corpus hamlet_gut --test-ctx 2048

c is the mean value row over a calibration sequence (the corpus's first ``--calib-ctx`` tokens);
the test sequence is the next ``--test-ctx`` tokens, from position 0 again. Per layer: exact causal
attention with f32 Q, K, V (sliding windows ignored, K exact) against the same with V stored by
the rotated row rule of q8h / q7h / q6h / q5h (kvlens' quantize_q8 with ``bits``, fp16 max_abs as
the packed kinds keep it, after the cache's Hadamard rotation), with and without c. The figure is
the relative output error ``|o_hat - o|^2 / |o|^2`` summed over layers: a proxy for KLD, as in
scripts/k_smoothing_probe.py, whose corpus and model loading it shares.
"""

from __future__ import annotations

import argparse

import torch
from k_smoothing_probe import calib_and_test, causal_attention, positive_int, probe_parser

from kvlens.kv import quant

BITS = (8, 7, 6, 5)


def nonnegative_int(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def row_rule(v: torch.Tensor, rot: torch.Tensor, bits: int) -> torch.Tensor:
    """V rows rotated, quantized by the q8 rule at ``bits`` with an fp16 max_abs, turned back."""
    codes, max_abs = quant.quantize_q8(v @ rot, bits=bits, fp16_scale=bits < 8)
    return quant.dequantize_q8(codes, max_abs, bits=bits) @ rot.T


def stored(v: torch.Tensor, c: torch.Tensor | None, rot: torch.Tensor, bits: int, sink: int) -> torch.Tensor:
    """V as attention reads it back: the first ``sink`` rows exact, the rest by :func:`row_rule`
    (of ``v - c``, plus ``c``, when centered)."""
    out = row_rule(v, rot, bits) if c is None else row_rule(v - c, rot, bits) + c
    out[:, :sink] = v[:, :sink]
    return out


def main() -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--calib-ctx", type=positive_int, default=512)
    ap.add_argument("--test-ctx", type=positive_int, default=2048)
    ap.add_argument(
        "--keep-sink", type=nonnegative_int, default=0, help="first rows kept exact (and out of c)"
    )
    args = ap.parse_args()
    if args.keep_sink >= args.calib_ctx:
        ap.error(f"--keep-sink {args.keep_sink} leaves no calibration row (--calib-ctx {args.calib_ctx})")
    calib, test = calib_and_test(ap, args)
    rot = quant.rotation(test[0][2].shape[-1]).to(torch.float32)
    plain, centered = dict.fromkeys(BITS, 0.0), dict.fromkeys(BITS, 0.0)
    offset_share = []
    for (q, k, v), (_, _, v_calib) in zip(test, calib, strict=True):
        exact = causal_attention(q, k, v)
        c = v_calib[:, args.keep_sink :].mean(1, keepdim=True)
        offset_share.append(float((c.squeeze(1).norm(dim=-1) ** 2 / v.pow(2).sum(-1).mean(-1)).mean()))
        for bits in BITS:
            for total, center in ((plain, None), (centered, c)):
                err = causal_attention(q, k, stored(v, center, rot, bits, args.keep_sink)) - exact
                total[bits] += float(err.norm() / exact.norm()) ** 2
    print(
        f"{args.model}, {args.corpus}: calibration {args.calib_ctx} tokens, test {args.test_ctx} tokens,"
        f" first {args.keep_sink} rows exact"
    )
    print(
        "  |c|^2 / mean |v|^2 per layer (mean over KV heads): " + " ".join(f"{s:.2f}" for s in offset_share)
    )
    for bits in BITS:
        ratio = centered[bits] / plain[bits]
        print(
            f"  V at {bits} bits (rotated row rule): sum of rel. error^2 {plain[bits]:.4g},"
            f" centered {centered[bits]:.4g}   centered / plain {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
