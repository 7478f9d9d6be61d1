"""The arms of ``kvlens bench serve --scenario multiturn`` (see ``kvlens.bench.multiturn``): one fresh
server per (KV mode, arm, concurrency), the small pool of the disk arms sized from the conversations,
llama-server beside them with ``--vs-llama-server``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..models.loader import resolve_model
from ..models.tokenizer import Tokenizer
from .multiturn import (
    ARM_FLAGS,
    TURN_HEADERS,
    Conversation,
    MultiturnLoad,
    TurnRow,
    conversation_tokens,
    conversations,
    counters_delta,
    counters_line,
    ratio_lines,
    run_conversations,
    turn_rows,
    turn_table,
)

if TYPE_CHECKING:
    from .serve import ServeBenchConfig


@dataclass(frozen=True)
class SmallPool:
    blocks: int
    budget_bytes: int
    conversation_blocks: int
    line: str


def small_pool(
    convs_tokens: list[int],
    shared_tokens: int,
    users: int,
    concurrency: int,
    block: int,
    bytes_per_token: int,
) -> SmallPool:
    """A pool of about a third of the conversations' distinct blocks (the shared system prefix is
    stored once, each conversation's own blocks once each), never fewer than the in-flight ones need."""
    shared = shared_tokens // block  # whole blocks of the prefix every conversation starts with
    own = math.ceil(max(convs_tokens) / block) + 1 - shared  # +1: the reply's last block
    blocks = max(math.ceil((shared + users * own) / 3), shared + concurrency * own)
    budget = blocks * block * bytes_per_token
    held = (blocks - shared) / own
    line = (
        f"disk/small arms: --kv-budget {budget} B = {blocks} blocks of {block} positions; a conversation "
        f"ends at <= {max(convs_tokens)} tokens: {shared} blocks shared by all + {own} of its own, so the pool "
        f"holds the shared prefix + {held:.1f} of the {users} conversations ({held / users:.0%})"
    )
    return SmallPool(blocks, budget, shared + own, line)


def serve_options() -> set[str]:
    """The ``--options`` this kvlens's ``kvlens serve`` accepts, from its ``--help`` (so an arm needing
    a missing one is skipped rather than failing the run)."""
    import os
    import re
    import subprocess
    import sys

    env = os.environ | {"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
    cmd = [sys.executable, "-m", "kvlens.cli", "serve", "--help"]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=True).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]*", text))


def run_against(url: str, engine: str, kv: str, arm: str, convs: list[Conversation], load: MultiturnLoad,
                api_key: str | None = None) -> tuple[list[TurnRow], str]:  # fmt: skip
    """One multi-turn run against a running server (after one short warm-up chat): its turn rows and
    the line of prefix-cache / disk-tier counters gained."""
    from ..serve.process import scrape_metrics, served_model

    model = served_model(url, api_key)
    warm = Conversation("Be brief.", ("Hello.",))  # compiles the kernels; shares no prefix with the load
    asyncio.run(run_conversations(url, model, [warm], MultiturnLoad(1, 1, 0, 0, 2, 1), api_key))
    before = scrape_metrics(url)
    samples = asyncio.run(run_conversations(url, model, convs, load, api_key))
    delta = counters_delta(before, scrape_metrics(url))
    label = f"{engine} {kv} {arm} conc. {load.concurrency}"
    errors = sorted({s.error for s in samples if s.error})
    return turn_rows(engine, kv, arm, load, samples), "\n".join([counters_line(label, delta), *errors])


def kv_bytes_per_token_of(model: str, kv: str) -> int:
    """KV bytes per position of ``model`` in mode ``kv``, from its config alone (no weights)."""
    import json

    from ..kv.modes import KVMode
    from ..kv.pool import kv_bytes_per_token
    from ..models.config import config_from_hf
    from ..models.gguf_loader import config_from_gguf, open_gguf

    path = resolve_model(model)
    cfg = (
        config_from_hf(json.loads((path / "config.json").read_text()))
        if path.is_dir()
        else config_from_gguf(open_gguf(path)[1])
    )
    return kv_bytes_per_token(KVMode.parse(kv), cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)


def kvlens_arm_args(
    cfg: ServeBenchConfig, kv: str, arm: str, pool: SmallPool, disk_dir: str, options: set[str]
) -> list[str]:
    from .serve import server_args

    small = arm in ("disk", "small")
    args = server_args(
        cfg.model, kv, cfg.weights, str(pool.budget_bytes) if small else cfg.kv_budget, cfg.max_batch
    )
    if arm == "no-cache":
        args.append("--no-prefix-cache")
    if arm == "disk":
        args += ["--kv-disk", disk_dir, "--kv-disk-budget", cfg.kv_disk_budget]
    if cfg.prefill_chunk and "--prefill-chunk" in options:
        args += ["--prefill-chunk", str(cfg.prefill_chunk)]
    return args


def run_arms(cfg: ServeBenchConfig, tok: Tokenizer, convs: list[Conversation], loads: list[MultiturnLoad],
             say: Callable[[str], None]) -> list[TurnRow]:  # fmt: skip
    """Every (KV mode, arm, load) against a fresh server; llama-server too with ``vs_llama_server``."""
    import tempfile

    from ..kv.cache import BLOCK
    from ..serve.process import ServerProcess
    from .llama_cpp import KV_TYPES
    from .llama_server import LlamaServerProcess, llama_server_args, threads

    options = serve_options() if cfg.arms and not cfg.url else set()
    if cfg.prefill_chunk and cfg.arms and not cfg.url and "--prefill-chunk" not in options:
        say(
            f"--prefill-chunk {cfg.prefill_chunk}: n/a, this kvlens serve has no --prefill-chunk (not passed)"
        )
    sizes = [conversation_tokens(tok, c, cfg.output_len) for c in convs]
    shared = conversation_tokens(tok, convs[0], cfg.output_len, turns=0)
    rows: list[TurnRow] = []
    if cfg.url:
        for load in loads:
            got, line = run_against(cfg.url.rstrip("/"), "server", "-", "-", convs, load, cfg.api_key)
            rows += got
            say(line)
    for kv in [] if cfg.url else cfg.kv:
        for load in loads:
            bpt = kv_bytes_per_token_of(cfg.model, kv)
            pool = small_pool(sizes, shared, load.users, load.concurrency, BLOCK, bpt)
            if {"disk", "small"} & set(cfg.arms):
                say(f"[{kv}, concurrency {load.concurrency}] {pool.line}")
            for arm in cfg.arms:
                if (flag := ARM_FLAGS[arm]) and flag not in options:
                    say(f"[kvlens {kv} {arm}] n/a: this kvlens serve has no {flag}")
                    continue
                with tempfile.TemporaryDirectory(prefix="kvlens-disk-") as disk:
                    with ServerProcess(kvlens_arm_args(cfg, kv, arm, pool, disk, options)) as srv:
                        got, line = run_against(srv.url, "kvlens", kv, arm, convs, load)
                rows += got
                say(line)
            if cfg.vs_llama_server and kv in KV_TYPES:
                args = llama_server_args(resolve_model(cfg.model), kv, load.concurrency, threads())
                with LlamaServerProcess(cfg.vs_llama_server, args) as srv:
                    got, line = run_against(srv.url, "llama-server", kv, "cache", convs, load)
                rows += got
                say(line)
    return rows


def main(cfg: ServeBenchConfig, tok: Tokenizer, json_out: bool) -> None:
    """The body of ``kvlens bench serve --scenario multiturn``."""
    import json
    import sys

    from ..report import print_table

    loads = [
        MultiturnLoad(cfg.users, cfg.turns, cfg.system_len, cfg.turn_len, cfg.output_len, c, cfg.seed)
        for c in cfg.concurrency or []
    ]
    convs = conversations(tok, cfg.corpus, loads[0])
    notes: list[str] = []
    rows = run_arms(cfg, tok, convs, loads, lambda line: notes.append(line) or print(line, file=sys.stderr))
    ratios = ratio_lines(rows)
    if json_out:
        print(json.dumps({"notes": notes, "turns": [r.as_dict() for r in rows], "ratios": ratios}, indent=1))
        return
    title = (
        f"bench serve --scenario multiturn: {cfg.model}, weights {cfg.weights}, {cfg.users} users x "
        f"{cfg.turns} turns (system {cfg.system_len} + {cfg.turn_len} tokens per user turn, "
        f"{cfg.output_len} output tokens)"
    )
    print_table(title, TURN_HEADERS, turn_table(rows), width=170)
    for line in ratios:
        print(line)
