"""Runs the model for the scheduler: one sequence's prefill chunk, or one decode row per sequence.

Batch invariance (a sequence's logits do not depend on what else runs) holds by construction:

* a prefill chunk is always one sequence's positions ``[start, end)``, cut at absolute multiples of
  the LLM's ``prefill_chunk`` (the scheduler's rule), so its rows go through exactly the matmuls
  and attention they go through alone;
* a decode step runs every sequence's token as one row of a batch, where each weight matrix is read
  once for the batch by the row kernels (:func:`kvlens.models.qlinear.linear_rows`), whose
  arithmetic for a row is the same whatever the other rows; the per-row glue (norms, RoPE,
  activation) and the attention (per sequence, Flash-Decoding splits chosen from that sequence's
  own length) run row by row.
"""

from __future__ import annotations

import torch

from ..kv.pool import PagedKV
from .attention import make_attend
from .llm import LLM


class ModelRunner:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    @torch.inference_mode()
    def prefill(self, kv: PagedKV, ids: list[int], start: int) -> torch.Tensor:
        """Run positions ``start ..`` of one sequence (its blocks held); the last position's logits."""
        hidden = self.llm.forward(ids, kv, start, prefill=True)
        return self.llm.model.logits(hidden[-1:])[0]

    @torch.inference_mode()
    def decode(self, kvs: list[PagedKV], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for a batch: token ``tokens[b]`` at ``positions[b]`` of sequence ``kvs[b]``.
        Returns logits ``[B, vocab]``."""
        llm = self.llm
        ids = torch.as_tensor(tokens, dtype=torch.long, device=llm.device)
        with llm.step_threads(True):  # the decode thread policy of LLM.forward's steps, as there
            # one sequence: each layer one compiled call where it applies (bit-identical to a batch's row)
            hidden = llm.forward_fused(ids, kvs[0], positions[0], llm.attn_backend) if len(kvs) == 1 else None
            if hidden is None:
                attends = [
                    make_attend(kv, False, llm.attn_backend, llm.config.layer_windows, step=llm.attend_step)
                    for kv in kvs
                ]
                hidden = llm.model.decode_rows(ids, positions, attends)
            return llm.model.logits_rows(hidden)
