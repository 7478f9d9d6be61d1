"""How much of 4-bit K's attention error is a constant offset per (layer, KV head)? A probe of
"K smoothing" (subtract one fixed vector c from every cached key of a head, as SageAttention
smooths K): softmax is unchanged by it in exact arithmetic, since every score of a query moves by
the same q·c, so only the quantization error changes. Not a cache mode of kvlens (see
docs/beyond-q8.md, "K smoothing").

    python scripts/k_smoothing_probe.py --model gemma3-270m --test-ctx 2048

c is the mean post-RoPE key over a calibration sequence (the corpus's first ``--calib-ctx``
tokens); the test sequence is the next ``--test-ctx`` tokens, starting again at position 0. Per
layer: exact causal attention with f32 Q, K, V (sliding windows ignored, V exact) vs the same with
K quantized (and dequantized) by each rule; the figure is the relative output error
``|o_hat - o|^2 / |o|^2`` summed over layers, and its ratio to q4h's (kvlens' q4h before the q4_0
rule: symmetric, d = absmax/7, after the Hadamard rotation). Both 4-bit rules are written out here
so the probe does not move when the cache's rule does.
"""

from __future__ import annotations

import argparse

import torch

import kvlens
from kvlens.corpus import load_corpus
from kvlens.kv import quant


def q4_dequant(x: torch.Tensor, q4_0: bool) -> torch.Tensor:
    """Blocks of 32 along the last dim, fp16 scale. ``q4_0``: llama.cpp's rule (d = signed max / -8,
    codes min(15, floor(x/d + 8.5)) - 8); else the symmetric rule (d = absmax/7, codes round(x/d))."""
    xg = x.reshape(*x.shape[:-1], -1, 32)
    if q4_0:
        d = torch.gather(xg, -1, xg.abs().argmax(-1, keepdim=True)).squeeze(-1) / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.clamp(torch.floor(xg * inv.unsqueeze(-1) + 8.5), 0, 15) - 8
    else:
        d = xg.abs().amax(-1) / 7.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.round(xg * inv.unsqueeze(-1)).clamp(-7, 7)
    return (codes * d.half().float().unsqueeze(-1)).reshape(x.shape)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    heads, n, d = q.shape
    group = heads // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = (q @ k.transpose(1, 2)) / d**0.5 + torch.triu(torch.full((n, n), float("-inf")), 1)
    return torch.softmax(s, -1) @ v


def variants(rot: torch.Tensor) -> dict:
    def rotated(k: torch.Tensor, q4_0: bool) -> torch.Tensor:
        return q4_dequant(k @ rot, q4_0) @ rot.T

    return {
        "q4 (absmax/7)": lambda k, c: q4_dequant(k, False),
        "q4 (absmax/7), smoothed": lambda k, c: q4_dequant(k - c, False) + c,
        "q4h (absmax/7)": lambda k, c: rotated(k, False),
        "q4h (absmax/7), smoothed": lambda k, c: rotated(k - c, False) + c,
        "q4 (q4_0)": lambda k, c: q4_dequant(k, True),
        "q4 (q4_0), smoothed": lambda k, c: q4_dequant(k - c, True) + c,
        "q4h (q4_0)": lambda k, c: rotated(k, True),
        "q4h (q4_0), smoothed": lambda k, c: rotated(k - c, True) + c,
    }


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def probe_parser(doc: str) -> argparse.ArgumentParser:
    """The probes' command line: ``--model`` and ``--corpus`` (each probe adds its lengths)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--corpus", default="britannica")
    return ap


def corpus_ids(model: str, corpus: str, n: int) -> tuple[kvlens.LLM, list[int]]:
    """The model with an f32 cache and the corpus's first ``n`` tokens; ValueError if it has fewer."""
    llm = kvlens.load(model, kv="f32")
    text, _ = load_corpus(corpus)
    ids = llm.encode_prompt(text[: 40 * n])
    if len(ids) < n:
        raise ValueError(f"corpus {corpus!r} gives {len(ids)} tokens; {n} are needed")
    return llm, ids[:n]


def calib_and_test(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list, list]:
    """Q, K, V per layer of the corpus's first ``args.calib_ctx`` tokens and of the ``args.test_ctx``
    after them, each a sequence from position 0; a bad model or corpus ends in ``ap.error``."""
    n = args.calib_ctx + args.test_ctx
    try:
        llm, ids = corpus_ids(args.model, args.corpus, n)
        return llm.capture_qkv(ids[: args.calib_ctx]), llm.capture_qkv(ids[args.calib_ctx : n])
    except (ValueError, TypeError) as e:
        ap.error(str(e))


def main() -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--calib-ctx", type=positive_int, default=512)
    ap.add_argument("--test-ctx", type=positive_int, default=2048)
    args = ap.parse_args()
    calib, test = calib_and_test(ap, args)
    rules = variants(quant.rotation(test[0][1].shape[-1]).to(torch.float32))
    total = dict.fromkeys(rules, 0.0)
    for (q, k, v), (_, k_calib, _) in zip(test, calib, strict=True):
        exact = causal_attention(q, k, v)
        c = k_calib.mean(1, keepdim=True)
        for name, rule in rules.items():
            total[name] += float((causal_attention(q, rule(k, c), v) - exact).norm() / exact.norm()) ** 2
    base = total["q4h (absmax/7)"]
    print(f"{args.model}, {args.corpus}: calibration {args.calib_ctx} tokens, test {args.test_ctx} tokens")
    for name, err in total.items():
        print(f"  {name:26s} sum of rel. error^2 {err:.4g}   x q4h (absmax/7) {err / base:.3f}")


if __name__ == "__main__":
    main()
