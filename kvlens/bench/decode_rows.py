"""The rows of ``kvlens bench decode`` and their printed table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .spread import MachineSpread, Spread, machine_lines, paired_ratio


@dataclass
class DecodeRow:
    engine: str
    weights: str
    mode: str
    ctx: int
    tok_per_s: float
    ms_per_tok: float
    kv_bytes: int
    rss_bytes: int
    backend: str
    step: str = ""  # kvlens rows: "fused" (one call per layer where it applies) or "general"
    # the step's time split (kvlens rows), ms per step over all layers:
    attn_ms: float | None = None  # inside attend: KV write + attention
    kv_write_ms: float | None = None  # the KV-write part of attn_ms (None: one compiled call with it)
    weights_ms: float | None = None  # inside the weight matmuls (QKV, O, gate/up, down, LM head)
    other_ms: float | None = None  # everything else: norms, RoPE, residuals, Python
    layers_ms: float | None = None  # fused step: inside the per-layer compiled calls (all of the above)
    # tok/s over the rounds (kvlens rows; tok_per_s is their median): how steady the figure is
    tok_per_s_min: float | None = None
    tok_per_s_max: float | None = None
    rounds: int | None = None
    round_tok_per_s: list[float] | None = None  # tok/s of each round, in run order (rounds interleave rows)
    machine: MachineSpread | None = None  # the machine's own speed between the same rounds (MachineProbe)

    @property
    def spread(self) -> Spread | None:
        if self.tok_per_s_min is None or self.tok_per_s_max is None:
            return None
        return Spread(self.tok_per_s_min, self.tok_per_s, self.tok_per_s_max)

    def as_dict(self) -> dict:
        s = self.spread
        return asdict(self) | {"spread": None if s is None else s.rel}


TABLE_HEADERS = (
    "engine", "weights", "KV", "step", "ctx", "tok/s", "min–max", "spread", "ms/tok", "× base KV",
    "× llama.cpp", "layers ms", "weights ms", "attn ms", "(KV write)", "other ms", "KV MiB", "RSS MiB",
)  # fmt: skip


def speed_ratio(row: DecodeRow, base: DecodeRow) -> float:
    """``row``'s speed over ``base``'s: the median over rounds of the two rows' tok/s ratio in the same
    round where both have their rounds (the rounds interleave the rows, so each ratio compares steps
    taken moments apart, and a machine whose speed drifts between rounds moves both alike); else the
    ratio of their medians."""
    return paired_ratio(row.round_tok_per_s, base.round_tok_per_s, row.tok_per_s / base.tok_per_s)


def table_rows(rows: list[DecodeRow], base_mode: str) -> list[list[str]]:
    """Printable rows: ``× base KV`` = speed over the ``base_mode`` row with the same engine, weights,
    step kind and context (:func:`speed_ratio`: paired by round); ``× llama.cpp`` = tok/s over
    llama-bench's row with the same KV mode and context."""
    base: dict[tuple, DecodeRow] = {}
    for r in rows:  # several backends: the first one's base row
        if r.mode == base_mode:
            base.setdefault((r.engine, r.weights, r.step, r.ctx), r)
    backends = {r.backend for r in rows if r.engine == "kvlens"}
    lcpp = {(r.mode, r.ctx): r.tok_per_s for r in rows if r.engine == "llama.cpp"}

    def ms(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}"

    out = []
    for r in rows:
        b, ref = base.get((r.engine, r.weights, r.step, r.ctx)), lcpp.get((r.mode, r.ctx))
        out.append(
            [
                r.engine,
                r.weights,
                f"{r.mode} ({r.backend})" if len(backends) > 1 and r.engine == "kvlens" else r.mode,
                r.step,
                str(r.ctx),
                f"{r.tok_per_s:.1f}",
                "" if r.spread is None else f"{r.spread.low:.1f}–{r.spread.high:.1f}",
                "" if r.spread is None else f"{r.spread.rel:.0%}",
                f"{r.ms_per_tok:.2f}",
                f"{speed_ratio(r, b):.2f}" if b else "",
                f"{r.tok_per_s / ref:.2f}" if ref else "",
                ms(r.layers_ms),
                ms(r.weights_ms),
                ms(r.attn_ms),
                ms(r.kv_write_ms),
                ms(r.other_ms),
                f"{r.kv_bytes / 2**20:.1f}",
                f"{r.rss_bytes / 2**20:.0f}" if r.rss_bytes else "",
            ]  # fmt: skip
        )
    return out


def machine_caption(rows: list[DecodeRow]) -> str:
    """The lines under the table: the machine's own speed over each context's rounds, then each row's
    read of its own step's bytes (weights and cache)."""
    sampled = [r for r in rows if r.machine is not None]
    text = machine_lines({f"ctx {r.ctx}": replace(r.machine, own_read=None, own_bytes=0) for r in sampled})
    own = [
        f"{r.weights} {r.mode} {r.step} ctx {r.ctx}: {r.machine.describe_own()}"
        for r in sampled
        if r.machine.own_read
    ]
    return text + ("\nreads of each step's own bytes between the rounds: " + "; ".join(own) if own else "")
