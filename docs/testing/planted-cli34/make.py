"""Write cli34.json: cli_config.py, cli_notice.py, cli_bench.py, cli_lab.py. Each bug's text must
occur once and the planted file must compile."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from planted_list import write_list  # noqa: E402

CF, N, B, LB = "kvlens/cli_config.py", "kvlens/cli_notice.py", "kvlens/cli_bench.py", "kvlens/cli_lab.py"

BUGS = [
    ("cfg-sparse-dense-layers-dropped", CF, "return SparseConfig(method, budget, dense_layers, min_ctx)", "return SparseConfig(method, budget, 0, min_ctx)"),
    ("cfg-raw-options-win", CF, "return cls(**{k: v for k, v in options.items() if k in names} | given)", "return cls(**given | {k: v for k, v in options.items() if k in names})"),
    ("cfg-names-none-empty", CF, "return None if text is None else split_mode_list(text)", "return [] if text is None else split_mode_list(text)"),
    ("cfg-prefill-min-zero", CF, 'PREFILL = Option(32, min=1,', 'PREFILL = Option(32, min=0,'),
    ("cfg-budget-unchecked", CF, 'help="Sparse budget: tokens, or a context fraction (< 1).", callback=cb.budget_option)', 'help="Sparse budget: tokens, or a context fraction (< 1).")'),
    ("cfg-dense-default-one", CF, 'DENSE = Option(2, min=0,', 'DENSE = Option(1, min=0,'),
    ("cfg-default-kv-short", CF, 'KV = Option("q8,q8-k,q8-v,f16",', 'KV = Option("q8,f16",'),
    ("cfg-shared-types-dropped", CF, 'run.__annotations__ = {p.name: p.annotation for p in own + shared} | {"return": None}', 'run.__annotations__ = {p.name: p.annotation for p in own} | {"return": None}'),
    ("notice-timer-per-nested-start", N, "if self._depth == 1 and not self.written.is_set():", "if not self.written.is_set():"),
    ("notice-inner-end-cancels", N, "if self._depth == 0 and self._timer is not None:", "if self._timer is not None:"),
    ("notice-fires-after-end", N, "if self.written.is_set() or self._depth == 0:", "if self.written.is_set():"),
    ("notice-written-twice", N, "            self.written.set()\n", "            pass\n"),
    ("notice-no-cache-path", N, 'where = f" (once: saved under {cache})" if cache else ""', 'where = ""'),
    ("notice-on-stdout", N, 'print(lead + line, file=sys.stderr, flush=True)', 'print(lead + line, flush=True)'),
    ("notice-after-ignored", N, "AFTER_S if after_s is None else after_s", "AFTER_S"),
    ("bench-sparse-ctx-default-kept", B, '    if sparse and ctx == "1k,4k,16k,64k":\n        ctx = "4k,16k,64k"\n', ""),
    ("bench-sparse-budget-strings", B, '"sparse_budget": parse_sizes(sparse_budget)}', '"sparse_budget": names(sparse_budget)}'),
    ("bench-decode-steps-min-one", B, 'steps: int = Option(12, min=3,', 'steps: int = Option(12, min=1,'),
    ("bench-serve-rate-zero", B, 'rate: float = typer.Option(None, min=0.001,', 'rate: float = typer.Option(None,'),
    ("bench-serve-concurrency-one", B, 'parse_sizes(concurrency) if concurrency else None', 'parse_sizes(concurrency) if concurrency else [1]'),
    ("bench-serve-arms-raw", B, 'lists = {"kv": names(kv), "arms": names(arms)}', 'lists = {"kv": names(kv)}'),
    ("lab-unit-head-dim-one", LB, '"--head-dim", min=2,', '"--head-dim", min=1,'),
    ("lab-ppl-ctx-two", LB, 'ctx: int = Option(512, min=4, help="Tokens per chunk; the second half of each is scored."),\n    chunks: int | None', 'ctx: int = Option(512, min=2, help="Tokens per chunk; the second half of each is scored."),\n    chunks: int | None'),
    ("lab-greedy-ctx-one", LB, 'ctx: int = Option(64, min=2,', 'ctx: int = Option(64, min=1,'),
    ("lab-compare-dense-fixed", LB, 'shared["sparse_budget"], shared["sparse_dense_layers"], 0)', 'shared["sparse_budget"], 2, 0)'),
    ("lab-layers-chunks-zero", LB, 'chunks: int = Option(1, min=1, help="Windows (ppl-protocol chunks) to pool."),', 'chunks: int = Option(1, min=0, help="Windows (ppl-protocol chunks) to pool."),'),
    ("lab-needle-depth-two", LB, "callback=cb.floats_option(0.0, 1.0)", "callback=cb.floats_option(0.0, 2.0)"),
    ("lab-sweep-force-quiet-swapped", LB, "cli(spec, db, workers, threads, ray, ray_address, force, quiet)", "cli(spec, db, workers, threads, ray, ray_address, quiet, force)"),
    ("lab-sweep-workers-min-one", LB, "workers: int | None = Option(None, min=0,", "workers: int | None = Option(None, min=1,"),
    ("lab-unit-trials-zero", LB, 'trials: int = Option(1, min=1,', 'trials: int = Option(1, min=0,'),
]

write_list(HERE / "cli34.json", BUGS)
