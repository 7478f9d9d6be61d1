"""How much KL divergence from an f32 cache each layer's (or KV head's) K or V costs in a kind.

One f32 pass per calibration chunk keeps the residual entering every layer and the base
log-probabilities. A mode that stores layers ``< first`` in f32 computes exactly what f32 computes
there, so its pass resumes from the kept residual at ``first``: a single-layer probe of layer L runs
``n_layers - L`` layers (half a forward on average) plus the LM head on the scored rows.

Every pass is one prefill of the whole chunk through the mode's cache (``prefill_chunk = ctx``). The
cache writes a chunk before attending it, so queries read the quantized rows of every position either
way; sub-chunks change a result only through float rounding (:mod:`.ppl`). The plan's held-out
verification runs the engine's own sub-chunked path.

``smooth_k`` (K smoothing, :attr:`kvlens.kv.modes.KVMode.k_center`): the f32 passes also average the
post-RoPE keys of every calibration position per (layer, KV head) (:attr:`Sensitivity.k_center`), and
the probes of :meth:`Sensitivity.table` carry those centers (:meth:`Sensitivity.centered`), as the
chosen recipe will; :meth:`Sensitivity.kld` measures a mode as given.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..engine.attention import make_attend
from ..engine.llm import LLM
from ..kv.modes import MODES, CacheOptions, KVMode, StoreKind
from ..kv.recipe import head_recipe_mode, with_k_center
from .ppl import scored_span

F32 = StoreKind.F32
ROLES = ("k", "v")
# a probe item: (layer, role) for a whole layer, (layer, head, role) for one KV head
Item = tuple[int, str] | tuple[int, int, str]


@dataclass
class _Chunk:
    inputs: list[torch.Tensor]  # residual entering each layer, f32 pass
    base_logits: torch.Tensor  # f32 logits of the scored rows
    p: torch.Tensor  # their softmax (f32)


def kld_rows(base_logits: torch.Tensor, p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(logits)) per row, ``p = softmax(base_logits)``, from the logit differences
    ``d = logits - base_logits``: ``KL = log(sum p e^d) - sum p d = log1p(sum p expm1(d)) - sum p d``.
    Both sums are of small terms, so f32 keeps ~1e-9 absolute accuracy where a float64 log-softmax of
    both sides (:func:`.ppl.chunk_metrics`) takes about twice as long over a 262k vocabulary."""
    d = logits.to(torch.float32) - base_logits
    mean_d = torch.einsum("ij,ij->i", p, d)
    return (torch.log1p(torch.einsum("ij,ij->i", p, torch.expm1(d))) - mean_d).to(torch.float64)


def probe_mode(n_layers: int, n_kv: int, item: Item, kind: StoreKind) -> KVMode:
    """Every row f32 except ``item``'s K or V (one layer, or one KV head of it), stored as ``kind``."""
    layer, role = item[0], item[-1]
    heads = range(n_kv) if len(item) == 2 else [item[1]]
    layers = [[(F32, F32)] * n_kv for _ in range(n_layers)]
    for h in heads:
        layers[layer][h] = (kind, F32) if role == "k" else (F32, kind)
    name = ".".join(str(x) for x in item)
    return head_recipe_mode(f"{name}={kind}", layers)


def first_changed(mode: KVMode, n_layers: int) -> int:
    """The first layer ``mode`` does not store all in f32 (``n_layers`` if none)."""
    for i in range(n_layers):
        pairs = mode.head_kinds(i) or (mode.kinds(i),)
        if any(p != (F32, F32) for p in pairs):
            return i
    return n_layers


class Sensitivity:
    """Mean KLD from f32 over calibration chunks, resuming each pass at the first changed layer."""

    def __init__(
        self,
        llm: LLM,
        chunks: list[list[int]],
        ctx: int,
        capture: bool = False,
        smooth_k: bool = False,
        options: CacheOptions | None = None,
    ) -> None:
        self.llm, self.ctx = llm, ctx
        self.options = options or CacheOptions()  # the probes' kept-exact positions (lab plan --keep-sink)
        self.first = scored_span(ctx)[0]
        # capture: the first chunk's post-RoPE (Q [H, n, d], K [KV, n, d], V) per layer, f32 pass
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        shape = (llm.config.n_layers, llm.config.n_kv_heads, llm.config.head_dim)
        self._k_sum = torch.zeros(shape, dtype=torch.float64) if smooth_k else None
        self.k_center: torch.Tensor | None = None  # the base passes are the uncentered f32 reference
        self.chunks = [self._base(c, capture and i == 0) for i, c in enumerate(chunks)]
        # smooth_k: the mean post-RoPE key per (layer, KV head) over every calibration position
        self.k_center = None if self._k_sum is None else (self._k_sum / sum(map(len, chunks))).float()
        self.passes = 0  # forwards run (base passes excluded)
        self.layers_run = 0  # of which, layers

    def centered(self, mode: KVMode) -> KVMode:
        """``mode`` as this sensitivity measures it: with its K centers where it smooths K."""
        return mode if self.k_center is None else with_k_center(mode, self.k_center)

    @torch.inference_mode()
    def _base(self, chunk: list[int], capture: bool) -> _Chunk:
        inputs: list[torch.Tensor] = []
        x = self.llm.model.embed(torch.tensor(chunk, dtype=torch.long, device=self.llm.device))
        k_sum = self._k_sum

        def seen(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            if capture and len(self.qkv) == i:
                self.qkv.append((q.clone(), k.clone(), v.clone()))
            if k_sum is not None:
                k_sum[i] += k.double().sum(1).cpu()

        hidden = self._run(x, MODES["f32"], 0, lambda _i, h: inputs.append(h), seen)
        logits = self._logits(hidden).to(torch.float32)
        return _Chunk(inputs, logits, torch.softmax(logits.to(torch.float64), -1).to(torch.float32))

    def _run(
        self, x: torch.Tensor, mode: KVMode, first: int, on_input=None, on_qkv=None, options=CacheOptions()
    ) -> torch.Tensor:
        """The pass from layer ``first`` (``on_qkv(layer, q, k, v)`` sees each layer's post-RoPE rows)."""
        llm = self.llm
        cache = llm.new_cache(x.shape[0], mode, options)
        inner = make_attend(cache, True, "torch", llm.config.layer_windows)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
            if on_qkv is not None:
                on_qkv(i, q, k, v)
            return inner(i, q, k, v, start)

        return llm.model.forward_from(x, 0, attend, first, on_input)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm.lm_head(hidden[self.first : self.ctx - 1])

    @torch.inference_mode()
    def kld(self, mode: KVMode) -> float:
        """Mean KLD of ``mode`` from f32 over the calibration chunks' scored tokens."""
        n = self.llm.config.n_layers
        first = first_changed(mode, n)
        if first == n:
            return 0.0
        vals = []
        for c in self.chunks:
            logits = self._logits(self._run(c.inputs[first], mode, first, options=self.options))
            vals.append(kld_rows(c.base_logits, c.p, logits).numpy())
            self.passes += 1
            self.layers_run += n - first
        return float(np.concatenate(vals).mean())

    def items(self, per_head: bool) -> Iterator[Item]:
        c = self.llm.config
        for layer in range(c.n_layers):
            for head in range(c.n_kv_heads) if per_head else [None]:
                for role in ROLES:
                    yield (layer, role) if head is None else (layer, head, role)

    def table(self, kinds: list[StoreKind], per_head: bool) -> dict[tuple, float]:
        """KLD per (item, kind): every layer's (``per_head``: every KV head's) K and V apart."""
        c = self.llm.config
        out: dict[tuple, float] = {}
        for item in self.items(per_head):
            for kind in kinds:
                out[(*item, kind)] = self.kld(self.centered(probe_mode(c.n_layers, c.n_kv_heads, item, kind)))
            if item[-1] == "v" and (not per_head or item[1] == c.n_kv_heads - 1):
                print(f"  sensitivity: layer {item[0] + 1}/{c.n_layers}", file=sys.stderr, flush=True)
        return out
