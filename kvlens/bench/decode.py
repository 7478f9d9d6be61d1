"""``kvlens bench decode``: full-model decode tokens/s per cache mode and context, side by side.

Every context is filled once with real K/V (an f32 prefill of corpus text); each mode's cache is
then written from those rows through its own store (so q8 rows are really quantized), and decode
steps are timed on top. Modes at one context are timed in one run, interleaved, so the ratios
printed compare like with like on a noisy machine. HF transformers' ``generate`` on the same
weights (default dynamic cache) is timed in the same run for reference.

``step``: ``fused`` is the engine's own decode step (each layer one compiled call where the cache and
backend allow: :mod:`kvlens.kernels.decode_step`; for layers it does not run, as Gemma-3's, each
layer's KV write and attention one compiled call, :mod:`kvlens.kernels.attend_step`, so the write is
not split out of the attention); ``general`` runs each layer's parts as separate
calls (``LLM.fused_step = False``), which is what the weights/attention split is measured on; ``both``
interleaves the two.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import psutil
import torch

from ..checks import check_counts, check_field_types, check_list_fields
from ..engine.attention import BackendError, check_backend_mode, check_backend_name
from ..engine.llm import LLM
from ..kv.cache import KVCache
from ..kv.modes import KVMode, split_mode_list
from .bandwidth import MachineProbe
from .decode_rows import TABLE_HEADERS, DecodeRow, machine_caption, table_rows
from .llama_cpp import find_binary
from .spread import LoadMeter, spread, spread_warning

ROUNDS = 5  # timed rounds per (weights, mode, context) in ``kvlens bench decode``
STEP_KINDS = ("fused", "general")


def corpus_ids(llm: LLM, n: int) -> list[int]:
    """n real-text token ids (the default corpus, repeated if it is short)."""
    from ..corpus import load_corpus

    text, _ = load_corpus(None)
    ids = llm.tokenizer.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def fill_cache(llm: LLM, source: KVCache, mode: str, length: int, capacity: int) -> KVCache:
    """A cache of ``mode`` holding the first ``length`` rows of an f32 ``source`` cache."""
    cache = llm.new_cache(capacity, mode)
    for layer in range(llm.config.n_layers):
        k, v = source.read(layer, length)
        cache.write(layer, 0, k, v)
    return cache


class _StepClock:
    """Sums the seconds the engine reports inside ``attend``, the KV write and the weight matmuls, as the
    model's profiler (:class:`kvlens.models.transformer.Profiler`) while installed: the timed step is
    the engine's own forward; a few perf_counter calls per layer cost ~1 µs each."""

    _PARTS = {"attend": "attend_s", "kv_write": "write_s", "linear": "linear_s", "layers": "layers_s"}

    def __init__(self, llm: LLM) -> None:
        self.model = llm.model
        self.reset()

    def add(self, part: str, seconds: float) -> None:
        name = self._PARTS[part]
        setattr(self, name, getattr(self, name) + seconds)

    def __enter__(self) -> _StepClock:
        self.model.profiler = self
        return self

    def __exit__(self, *exc) -> None:
        self.model.profiler = None

    def reset(self) -> None:
        self.attend_s = self.write_s = self.linear_s = self.layers_s = 0.0


@torch.inference_mode()
def time_decode(
    llm: LLM, cache: KVCache, pos: int, steps: int, backend: str, warmup: int = 2
) -> tuple[float, ...]:
    """Median seconds per decode step at position ``pos`` (the cache holds ``pos`` rows, the step
    attends ``pos + 1``), and of its time in attention, in KV writes, in weight matmuls and in fused
    layer calls (all layers); the cache is rewound after every step."""
    tok = 198  # any id: the cost of a step does not depend on it
    timed: list[tuple[float, ...]] = []
    with _StepClock(llm) as clock:
        for i in range(warmup + steps):
            clock.reset()
            t0 = time.perf_counter()
            h = llm.forward([tok], cache, pos, prefill=False, backend=backend)
            llm.lm_head(h)
            if h.device.type == "cuda":  # the step's total is then right; its split is launch time only
                torch.cuda.synchronize(h.device)
            if i >= warmup:
                parts = (clock.attend_s, clock.write_s, clock.linear_s, clock.layers_s)
                timed.append((time.perf_counter() - t0, *parts))
            cache.truncate(pos)
    return median_step(timed)


def median_step(timed: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The step (total, then its parts) with the median total: robust to the odd descheduled step,
    and its parts add up (a median per part would mix steps)."""
    return sorted(timed)[len(timed) // 2]


class _TokenClock:
    """A ``generate`` streamer that timestamps every new token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_time(llm: LLM, ids: list[int], steps: int) -> float | None:
    """Median seconds per decode step of HF transformers' greedy ``generate`` after a ``len(ids)`` prompt."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    src = llm.source
    kwargs = {"gguf_file": src.name} if src.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(
        src.parent if src.suffix == ".gguf" else src, dtype=torch.float32, **kwargs
    ).eval()
    clock = _TokenClock()
    with torch.inference_mode():
        model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps + 2,
            min_new_tokens=steps + 2,
            do_sample=False,
            streamer=clock,
        )
    del model
    gc.collect()
    # stamps: prompt, token 1 (after prefill), then one per decode step; skip the first step (warm-up)
    deltas = sorted(b - a for a, b in zip(clock.stamps[2:], clock.stamps[3:], strict=False))
    return deltas[len(deltas) // 2]


def run_decode_bench(
    llms: list[LLM],
    contexts: list[int],
    modes: list[str],
    steps: int = 12,
    backend: str | None = None,
    with_hf: bool = True,
    llama_bench: str | None = None,
    progress=None,
    rounds: int = 5,
    step_kinds: tuple[str, ...] = ("fused",),
    probe: MachineProbe | None = None,
) -> list[DecodeRow]:
    """Rows for every (weights, KV mode, step kind) at every context: ``llms`` are the weight modes
    (one loaded model each); at one context all of them run interleaved, ``rounds`` times ``steps``
    timed steps each (the row's tok/s is the median round, its min and max show the spread), then HF
    and llama-bench if asked. ``step_kinds``: ``fused`` and/or ``general`` (module docstring).
    ``probe``: samples the machine's speed after every round (:class:`.bandwidth.MachineProbe`; rows carry it)."""
    rows: list[DecodeRow] = []
    first = llms[0]
    for ctx in contexts:
        # the timed step attends exactly ctx positions (ctx - 1 cached + itself): ctx may be the
        # model's whole window (SmolLM2: 8192)
        first.check_fits(ctx)
        ids = corpus_ids(first, ctx - 1)
        source = first.new_cache(ctx - 1, "f32")
        # torch attention: an integer backend refuses the f32 cache (prefill runs torch's path anyway)
        first.variant(attn_backend="torch").prefill(ids, source, chunk=512)
        caches = {m: fill_cache(first, source, m, ctx - 1, ctx) for m in modes}
        del source
        gc.collect()
        runs = [
            (step_variant(llm, k), m, k)
            for llm in llms
            for k in step_kinds
            for m in modes
            if backend_reads(llm.attn_backend, m)
        ]
        rows += timed_rows(runs, caches, ctx, steps, rounds, backend, probe)
        del caches
        gc.collect()
        if with_hf and (t := hf_decode_time(first, ids, steps)) is not None:
            cfg, rss = first.config, bench_rss(probe)
            kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * ctx
            rows.append(
                DecodeRow(
                    "transformers", "f32", "f32 (DynamicCache)", ctx, 1 / t, 1e3 * t, kv_bytes, rss, "sdpa"
                )
            )
        if llama_bench:
            rows += llama_cpp_rows(first, llama_bench, modes, ctx, steps)
        if progress:
            progress(ctx)
    return rows


def bench_rss(probe: MachineProbe | None) -> int:
    """This process's resident bytes, less the machine probe's read buffer (not the model's memory)."""
    return psutil.Process().memory_info().rss - (probe.nbytes if probe else 0)


def backend_reads(backend: str, mode: str) -> bool:
    """Whether attention ``backend`` decodes over a ``mode`` cache (an integer backend needs K kinds it
    can score and no packed rows: the engine's own check, :func:`kvlens.engine.attention.check_backend_mode`)."""
    try:
        check_backend_mode(backend, KVMode.parse(mode))
    except BackendError:
        return False
    return True


def step_variant(llm: LLM, kind: str) -> LLM:
    """``llm`` running decode steps of ``kind``: ``fused`` (the engine's default) or ``general``."""
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; choose from {', '.join(STEP_KINDS)}")
    return llm if kind == "fused" else llm.variant(fused_step=False)


def timed_rows(
    runs: list[tuple[LLM, str, str]], caches: dict[str, KVCache], ctx: int, steps: int, rounds: int,
    backend: str | None, probe: MachineProbe | None = None,
) -> list[DecodeRow]:  # fmt: skip
    """kvlens rows of every (llm, mode, step kind) run, timed interleaved at one context."""
    per_run: list[list[tuple[float, ...]]] = [[] for _ in runs]
    first_sample = len(probe.reads) if probe else 0
    # what each run's step reads: its weights and its whole cache (the probe reads as much between rounds)
    step_bytes = [llm.step_weight_bytes + caches[m].bytes_per_token() * ctx for llm, m, _k in runs]
    for _ in range(rounds):  # interleave every run so drift hits them alike
        for i, (llm, m, _k) in enumerate(runs):
            per_run[i].append(time_decode(llm, caches[m], ctx - 1, steps, backend or llm.attn_backend))
        if probe is not None:
            probe.sample(step_bytes)
    rss = bench_rss(probe)
    rows = []
    for (llm, m, kind), timed, own in zip(runs, per_run, step_bytes, strict=True):
        machine = probe.spread(first_sample, own) if probe else None
        t, attn, write, lin, layers = median_step(timed)  # the median round
        s = spread([1 / r[0] for r in timed])
        # fused layers: no attention split; a fused attention call (kernels.attend_step): no write split
        split = (None, None) if layers else (1e3 * attn, 1e3 * write if write else None)
        rows.append(
            DecodeRow(
                "kvlens", llm.weights_mode, m, ctx, 1 / t, 1e3 * t, caches[m].bytes_per_token() * ctx, rss,
                backend or llm.attn_backend, kind, *split, 1e3 * lin, 1e3 * (t - attn - lin - layers),
                1e3 * layers if layers else None, s.low, s.high, len(timed),
                [1 / r[0] for r in timed], machine,
            )
        )  # fmt: skip
    return rows


def llama_cpp_rows(llm: LLM, binary: str, modes: list[str], ctx: int, steps: int) -> list[DecodeRow]:
    """llama-bench on the same GGUF, threads and KV types (see :mod:`.llama_cpp`); weights: the file's."""
    from .llama_cpp import kv_bytes, run_llama_bench

    cfg, out = llm.config, []
    for m in modes:
        r = run_llama_bench(binary, llm.source, m, ctx, steps, torch.get_num_threads())
        if r is not None:
            size = kv_bytes(r.kv_type, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, ctx)
            out.append(
                DecodeRow(
                    "llama.cpp",
                    "file",
                    m,
                    ctx,
                    r.tok_per_s,
                    1e3 / r.tok_per_s,
                    size,
                    r.peak_rss,
                    f"{r.kv_type} fa",
                )
            )
    return out


@dataclass
class DecodeBenchConfig:
    """``kvlens bench decode``: every weights mode × KV mode × context, ``steps`` timed decode steps
    each; HF transformers beside it up to ``hf_max_ctx``, llama-bench (``vs_llama_cpp``) if given."""

    model: str = "smollm2"
    ctx: list[int] = field(default_factory=lambda: [512, 2048, 4096])
    kv: list[str] = field(default_factory=lambda: ["f32", "f16", "q8"])
    weights: list[str] = field(default_factory=lambda: ["auto"])
    steps: int = 12
    attn_backend: list[str] = field(default_factory=lambda: ["auto"])  # several: every mode under each
    hf: bool = True
    hf_max_ctx: int = 2048
    vs_llama_cpp: str | None = None
    step: str = "fused"  # fused, general, or both (interleaved)

    def __post_init__(self) -> None:
        check_field_types(self)
        kinds = {"kv": str, "weights": str, "attn_backend": str, "ctx": int}
        check_list_fields(self, kinds, split=split_mode_list)
        check_counts(self, "ctx")
        check_counts(self, "steps", minimum=3)  # the CLI's floor
        check_counts(self, "hf_max_ctx", minimum=0)
        if self.step not in (*STEP_KINDS, "both"):
            raise ValueError(f"step must be one of {', '.join(STEP_KINDS)}, both; got {self.step!r}")
        from ..models.loader import check_weights_mode

        for m in self.kv:
            KVMode.parse(m)
        for w in self.weights:
            check_weights_mode(w)
        for b in self.attn_backend:
            check_backend_name(b)
        # after the names: a malformed one is named as such, not as a backend that reads no mode
        if not any(backend_reads(b, m) for b in self.attn_backend for m in self.kv):
            raise ValueError(
                f"no --attn-backend of {','.join(self.attn_backend)} reads any --kv mode of {','.join(self.kv)}"
                " (the integer backends read int8 K: q8, q8h, q8-k, q8+mirror; numba-int also q4, q4h)"
            )
        if self.vs_llama_cpp:
            find_binary(self.vs_llama_cpp)  # fail before the long run


def main(cfg: DecodeBenchConfig, json_out: bool = False) -> None:
    """The body of ``kvlens bench decode``."""
    import sys

    import kvlens

    from ..report import dump_json, print_table

    loaded = [
        kvlens.load(cfg.model, kv=cfg.kv[0], attn_backend=cfg.attn_backend[0], weights=w) for w in cfg.weights
    ]
    llms = [
        llm.variant(attn_backend=b) if b != cfg.attn_backend[0] else llm
        for llm in loaded
        for b in cfg.attn_backend
    ]
    if cfg.vs_llama_cpp and llms[0].source.suffix != ".gguf":
        raise ValueError("--vs-llama-cpp needs a GGUF model")
    rows: list[DecodeRow] = []
    meter, probe = LoadMeter(), MachineProbe()
    for c in cfg.ctx:
        rows += run_decode_bench(
            llms, [c], cfg.kv, cfg.steps, rounds=ROUNDS, with_hf=cfg.hf and c <= cfg.hf_max_ctx,
            llama_bench=cfg.vs_llama_cpp,
            progress=None if json_out else lambda c: print(f"  ctx {c} done", file=sys.stderr),
            step_kinds=STEP_KINDS if cfg.step == "both" else (cfg.step,), probe=probe,
        )  # fmt: skip
    load = meter.read()
    if json_out:
        print(dump_json([r.as_dict() for r in rows], indent=1))
    else:
        first = llms[0]
        title = (
            f"decode, {first.source.name}, {first.config.n_layers} layers, {torch.get_num_threads()} threads; "
            f"tok/s = median of {ROUNDS} rounds of {cfg.steps} steps, min–max over the rounds"
        )
        print_table(title, TABLE_HEADERS, table_rows(rows, cfg.kv[0]), width=190)
        print(machine_caption(rows))
    for r in rows:
        if r.spread is not None:
            what = f"{r.engine} {r.weights} {r.mode} ctx {r.ctx} tok/s"
            line = spread_warning(what, r.spread, load, machine=r.machine)
            if line:
                print(line, file=sys.stderr)
