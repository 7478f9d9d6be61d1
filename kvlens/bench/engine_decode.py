"""``kvlens bench engine``: aggregate decode tokens/s of the serving engine per cache mode and batch
size, side by side in one run, without HTTP.

Each batch size B runs B requests (prompts of ``prompt_len`` tokens cut from the corpus at seeded
offsets) through one fresh :class:`~kvlens.engine.scheduler.Engine` whose pool holds just them; once
every prompt is prefilled, ``steps`` decode steps are timed. A round times every (mode, batch) cell
once, the cells in turn, so a machine whose speed drifts between rounds moves them all alike; round 0
warms up (compiles) and is not counted. A cell reports the median tok/s over the rounds and its
min–max; ``× batch 1`` and ``× <first mode>`` are medians of ratios taken within each round. The row
``loop`` is the LLM's own one-sequence decode loop over a contiguous cache (``generate_ids(cache=…)``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..checks import check_counts, check_field_types, check_list_fields
from ..engine.llm import LLM
from ..engine.serving import Engine, EngineConfig, Request, fitted_config
from ..kv.modes import KVMode, split_mode_list
from ..kv.pool import kv_bytes_per_token
from .bandwidth import MachineProbe
from .spread import Spread, paired_ratio, spread

MAX_BATCH = 1024
LOOP = "loop"  # the batch label of the contiguous-cache loop's row
HEADERS = ("KV", "batch", "tok/s", "min–max", "spread", "× batch 1", "× first KV", "KV MiB")


@dataclass
class EngineBenchConfig:
    """``kvlens bench engine``: every (KV mode, batch size) cell, and with ``loop`` each mode's
    contiguous-cache loop, timed over ``rounds`` interleaved rounds of ``steps`` decode steps."""

    model: str = "smollm2"
    kv: list[str] = field(default_factory=lambda: ["q8", "f16"])
    weights: str = "auto"
    batches: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    prompt_len: int = 64
    steps: int = 16
    rounds: int = 5
    loop: bool = True
    corpus: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_field_types(self)
        from ..models.loader import check_weights_mode

        check_list_fields(self, {"kv": str, "batches": int}, split=split_mode_list)
        for m in self.kv:
            KVMode.parse(m)
        check_weights_mode(self.weights)
        if not self.batches or not all(1 <= b <= MAX_BATCH for b in self.batches):
            raise ValueError(f"--batches must list whole numbers in [1, {MAX_BATCH}], got {self.batches!r}")
        check_counts(self, "prompt_len", "steps", "rounds")


@dataclass
class EngineRow:
    kv: str
    batch: int | str  # a batch size, or LOOP
    round_tok_s: list[float]  # each round's tok/s, in run order
    kv_bytes: int  # the pool the cell's engine was given (the loop: its contiguous cache)
    x_batch1: float | None = None  # over the same mode's batch-1 row, paired by round
    x_first_kv: float | None = None  # over the first mode's row of the same batch, paired by round

    @property
    def spread(self) -> Spread:
        return spread(self.round_tok_s)

    @property
    def tok_s(self) -> float:
        """The median over the rounds."""
        return self.spread.median

    def as_dict(self) -> dict:
        s = self.spread
        return asdict(self) | {"tok_s": s.median, "tok_s_min": s.low, "tok_s_max": s.high, "spread": s.rel}


def kv_bytes(llm: LLM, positions: int) -> int:
    """KV bytes of ``positions`` positions in ``llm``'s cache mode (all layers)."""
    cfg = llm.config
    return positions * kv_bytes_per_token(llm.kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)


def round_engine_config(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[list[Request], EngineConfig]:
    """A round's requests (``steps`` + 2 new tokens each: the prefill's token and one untimed decode
    step) and the engine config whose pool holds them all whole (the engine's :func:`fitted_config`)."""
    reqs = [Request(f"r{i}", ids, steps + 2, stop_ids=frozenset()) for i, ids in enumerate(prompts)]
    return reqs, fitted_config(llm, reqs, max_batch=len(reqs), prefill_token_budget=4096)


def engine_round(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Tokens/s of ``steps`` decode steps of ``len(prompts)`` sequences decoding together: every prompt
    prefilled and one token decoded first, so each timed step feeds every sequence one token."""
    reqs, config = round_engine_config(llm, prompts, steps)
    engine = Engine(llm, config)
    for req in reqs:
        engine.add_request(req)
    while engine.waiting or any(s.in_prefill for s in engine.running):
        engine.step()
    engine.step()
    t0 = time.perf_counter()
    tokens = sum(len(engine.step()) for _ in range(steps))
    return tokens / (time.perf_counter() - t0)


def loop_round(llm: LLM, prompt: list[int], steps: int) -> float:
    """Tokens/s of the LLM's own one-sequence decode loop over a contiguous cache, ``steps`` tokens
    after the prefill's."""
    cache = llm.new_cache(len(prompt) + steps + 1)
    gen = llm.generate_ids(prompt, steps + 1, stop_at_eos=False, cache=cache)
    next(gen)  # the prefill
    t0 = time.perf_counter()
    n = sum(1 for _ in gen)
    return n / (time.perf_counter() - t0)


Cell = tuple[str, int | str]  # (KV mode, batch size or LOOP)


def cells(cfg: EngineBenchConfig) -> list[Cell]:
    return [(kv, b) for kv in cfg.kv for b in ([LOOP] if cfg.loop else []) + list(cfg.batches)]


def run_engine_bench(
    cfg: EngineBenchConfig,
    llms: dict[str, LLM],
    prompts: list[list[int]],
    step: Callable[[str], None],
    probe: MachineProbe | None = None,
) -> list[EngineRow]:
    """Every cell once per round, ``cfg.rounds`` counted rounds after one warm-up; rows with ratios.
    ``probe``: the machine's own speed, sampled after every counted round."""
    rates: dict[Cell, list[float]] = {c: [] for c in cells(cfg)}
    for rnd in range(cfg.rounds + 1):
        for kv, batch in rates:
            llm = llms[kv]
            if batch == LOOP:
                rate = loop_round(llm, prompts[0], cfg.steps)
            else:
                rate = engine_round(llm, prompts[: int(batch)], cfg.steps)
            if rnd:
                rates[(kv, batch)].append(rate)
        if rnd and probe is not None:
            probe.sample()
        step("warm-up" if rnd == 0 else f"round {rnd}")
    rows = []
    for (kv, batch), got in rates.items():
        if batch == LOOP:
            held = kv_bytes(llms[kv], cfg.prompt_len + cfg.steps + 1)
        else:
            held = round_engine_config(llms[kv], prompts[: int(batch)], cfg.steps)[1].kv_budget_bytes
        rows.append(EngineRow(kv, batch, got, held))
    return with_ratios(rows)


def with_ratios(rows: list[EngineRow]) -> list[EngineRow]:
    """Each row's ``× batch 1`` (its mode's batch-1 row) and ``× first KV`` (the first mode's row of the
    same batch), each the median of the two rows' per-round ratio."""
    by = {(r.kv, r.batch): r for r in rows}
    first = rows[0].kv if rows else None
    for r in rows:
        for attr, base in (("x_batch1", by.get((r.kv, 1))), ("x_first_kv", by.get((first, r.batch)))):
            if base is not None:
                setattr(r, attr, paired_ratio(r.round_tok_s, base.round_tok_s, r.tok_s / base.tok_s))
    return rows


def table_rows(rows: list[EngineRow]) -> list[list[str]]:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    return [
        [r.kv, str(r.batch), f"{r.tok_s:.1f}", f"{r.spread.low:.1f}–{r.spread.high:.1f}", f"{r.spread.rel:.0%}",
         x(r.x_batch1), x(r.x_first_kv), f"{r.kv_bytes / 2**20:.2f}"]
        for r in rows
    ]  # fmt: skip


def main(cfg: EngineBenchConfig, json_out: bool = False) -> None:
    """The body of ``kvlens bench engine``."""
    import kvlens

    from ..report import CommandOutput, print_table, run_command
    from .serve import corpus_prompts
    from .spread import LoadMeter, spread_warning

    first = kvlens.load(cfg.model, kv=cfg.kv[0], weights=cfg.weights)
    if (need := cfg.prompt_len + cfg.steps + 2) > first.config.max_ctx:
        raise ValueError(
            f"--prompt-len {cfg.prompt_len} + --steps {cfg.steps} + 2 = {need} positions do not fit in the "
            f"model's context of {first.config.max_ctx}"
        )
    llms = {m: first if m == cfg.kv[0] else first.variant(kv=m) for m in cfg.kv}
    prompts = corpus_prompts(first.tokenizer, cfg.corpus, max(cfg.batches), cfg.prompt_len, cfg.seed)
    meter, probe = LoadMeter(), MachineProbe()  # other processes' CPU, the machine's own speed: the causes

    def render(rows: list[EngineRow]) -> None:
        title = (
            f"bench engine: {cfg.model}, weights {cfg.weights}, prompt {cfg.prompt_len} tokens; tok/s = median "
            f"of {cfg.rounds} rounds of {cfg.steps} decode steps (all sequences together), min–max over them"
        )
        print_table(title, HEADERS, table_rows(rows), width=130)

    output = CommandOutput(render, lambda rows: [r.as_dict() for r in rows])
    rows = run_command("bench engine", cfg.rounds + 1, lambda step: run_engine_bench(cfg, llms, prompts, step, probe),
                       output, json_out)  # fmt: skip
    load, machine = meter.read(), probe.spread()
    for r in rows:
        if line := spread_warning(f"{r.kv} batch {r.batch} tok/s", r.spread, load, machine=machine):
            print(line, file=sys.stderr)
