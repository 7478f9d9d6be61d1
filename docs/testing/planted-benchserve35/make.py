"""Write benchserve35.json: the benchmarks over real servers and their pieces (kvlens/bench/serve.py,
multiturn.py, multiturn_arms.py, llama_server.py), bench/sparse.py, bench/engine_decode.py and the
tour's serving step (kvlens/serve/tour.py). Each bug's text must occur once and the planted file
must compile."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from planted_list import write_list  # noqa: E402

S = "kvlens/bench/serve.py"
M = "kvlens/bench/multiturn.py"
A = "kvlens/bench/multiturn_arms.py"
P = "kvlens/bench/sparse.py"
L = "kvlens/bench/llama_server.py"
T = "kvlens/serve/tour.py"
E = "kvlens/bench/engine_decode.py"
SCH = "kvlens/engine/scheduler.py"  # the engine's fitted pool, which bench engine sizes its rounds with
SP = "kvlens/bench/spread.py"
N = "kvlens/cli_notice.py"
C = "kvlens/checks.py"
U = "kvlens/lab/unit.py"

BUGS = [
    ("serve-prompt-one-short", S, "return [ids[s : s + prompt_len] for s in starts]", "return [ids[s : s + prompt_len - 1] for s in starts]"),
    ("serve-prompts-one-offset", S, "starts = [rng.randrange(0, len(ids) - prompt_len) for _ in range(n)]", "starts = [rng.randrange(0, len(ids) - prompt_len)] * n"),
    ("serve-prompts-seed-ignored", S, "rng = random.Random(seed)", "rng = random.Random(0)"),
    ("serve-itl-from-first", S, "itls.append(now - last)", "itls.append(now - first)"),
    ("serve-ttft-is-latency", S, "return Sample(True, None, tokens, (first or end) - t0, end - t0, itls)", "return Sample(True, None, tokens, end - t0, end - t0, itls)"),
    ("serve-tokens-are-prompt", S, "tokens = chunk.usage.completion_tokens", "tokens = chunk.usage.prompt_tokens"),
    ("serve-gate-uncapped", S, "gate = asyncio.Semaphore(load.concurrency or len(prompts))", "gate = asyncio.Semaphore(len(prompts))"),
    ("serve-rate-ignored", S, "        if load.rate:\n            await", "        if False:\n            await"),
    ("serve-rate-as-gap", S, "rng.exponential(1.0 / load.rate)", "rng.exponential(load.rate)"),
    ("serve-failed-zero", S, "kv, load.concurrency, load.rate, len(samples), len(samples) - len(ok), duration, out,", "kv, load.concurrency, load.rate, len(samples), 0, duration, out,"),
    ("serve-req-s-counts-failed", S, "out / duration, len(ok) / duration,", "out / duration, len(samples) / duration,"),
    ("serve-ttft-p99-is-p90", S, "float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 99)),", "float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 90)),"),
    ("serve-itl-first-request-only", S, "itls = np.array([g for s in ok for g in s.itls]) if", "itls = np.array(ok[0].itls) if"),
    ("serve-ttft-of-failed", S, "ttfts = np.array([s.ttft for s in ok]) if ok", "ttfts = np.array([s.ttft for s in samples]) if ok"),
    ("serve-preempt-total", S, 'preempt = int(scrape_metrics(url).get("kvlens_preemptions_total", 0.0) - before)', 'preempt = int(scrape_metrics(url).get("kvlens_preemptions_total", 0.0))'),
    ("serve-x-conc1-any-mode", S, "        base = single.get(r.kv)\n", "        base = next(iter(single.values()), None)\n"),
    ("serve-mode-ratio-inverted", S, 'lines.append(f"{what} output tok/s at {load}: {a.output_tok_s / b.output_tok_s:.2f}x")', 'lines.append(f"{what} output tok/s at {load}: {b.output_tok_s / a.output_tok_s:.2f}x")'),
    ("serve-mode-ratio-any-load", S, "(r for r in results if r.kv == other and (r.concurrency, r.rate) == (a.concurrency, a.rate)),", "(r for r in results if r.kv == other),"),
    ("serve-multiturn-conc-floor", S, "[-(-self.users // 3)]", "[max(1, self.users // 3)]"),
    ("serve-llama-rate-allowed", S, "            if self.rate:\n                raise", "            if False:\n                raise"),
    ("serve-requests-default", S, "Load(cfg.requests or max(4, 2 * (c or 4))", "Load(cfg.requests or max(4, c or 4)"),
    ("serve-budget-dropped", S, 'return args + (["--kv-budget", kv_budget] if kv_budget else [])', "return args"),
    ("serve-url-slash-kept", S, 'results = runs_against(cfg.url.rstrip("/"), "server"', 'results = runs_against(cfg.url, "server"'),
    ("mt-turns-overlap", M, "Conversation(system, tuple(texts[u * load.turns : (u + 1) * load.turns]))", "Conversation(system, tuple(texts[u : u + load.turns]))"),
    ("mt-system-len-ignored", M, "system = SYSTEM_HEAD + tok.decode(windows[0][: load.system_len]).strip()", "system = SYSTEM_HEAD + tok.decode(windows[0]).strip()"),
    ("mt-reply-not-cut", M, "reply = tok.decode(tok.encode(text, add_bos=False)[:output_len])", "reply = text"),
    ("mt-size-with-gen-prompt", M, "tok.apply_chat_template(messages, add_generation_prompt=False)", "tok.apply_chat_template(messages, add_generation_prompt=True)"),
    ("mt-ttft-last-chunk", M, "first = first or time.perf_counter()", "first = time.perf_counter()"),
    ("mt-cached-unknown-as-zero", M, "details.cached_tokens if details is not None else None", "details.cached_tokens if details is not None else 0"),
    ("mt-reply-as-user", M, 'messages.append({"role": "assistant", "content": reply})', 'messages.append({"role": "user", "content": reply})'),
    ("mt-go-on-after-failure", M, "        if not sample.ok:\n            break", "        if not sample.ok:\n            continue"),
    ("mt-failed-zero", M, "engine, kv, arm, load.concurrency, turn, len(mine), len(mine) - len(ok),", "engine, kv, arm, load.concurrency, turn, len(mine), 0,"),
    ("mt-p90-is-p50", M, "float(np.percentile(ttft, 50)), float(np.percentile(ttft, 90)), prompt, cached,", "float(np.percentile(ttft, 50)), float(np.percentile(ttft, 50)), prompt, cached,"),
    ("mt-cached-known-if-any", M, "known = bool(ok) and all(s.cached_tokens is not None for s in ok)", "known = bool(ok) and any(s.cached_tokens is not None for s in ok)"),
    ("mt-computed-sign", M, "prompt - cached if cached is not None else None,", "cached - prompt if cached is not None else None,"),
    ("mt-counters-not-delta", M, "return {m: after[m] - before.get(m, 0.0) if m in after else None for m in PREFIX_METRICS}", "return {m: after[m] if m in after else None for m in PREFIX_METRICS}"),
    ("mt-share-inverted", M, 'share = f"{hit / prompt:.0%}" if hit is not None and prompt else "n/a"', 'share = f"{prompt / hit:.0%}" if hit and prompt else "n/a"'),
    ("mt-followup-with-turn1", M, "return float(np.median(mine[1:])) if len(mine) > 1 else None", "return float(np.median(mine)) if len(mine) > 1 else None"),
    ("mt-disk-ratio-swapped", M, '(("kvlens", "disk"), ("kvlens", "no-cache"), "disk tier / recompute"),', '(("kvlens", "no-cache"), ("kvlens", "disk"), "disk tier / recompute"),'),
    ("arms-half-not-third", A, "blocks = max(math.ceil((shared + users * own) / 3), shared + concurrency * own)", "blocks = max(math.ceil((shared + users * own) / 2), shared + concurrency * own)"),
    ("arms-no-inflight-floor", A, "blocks = max(math.ceil((shared + users * own) / 3), shared + concurrency * own)", "blocks = math.ceil((shared + users * own) / 3)"),
    ("arms-no-reply-block", A, "own = math.ceil(max(convs_tokens) / block) + 1 - shared", "own = math.ceil(max(convs_tokens) / block) - shared"),
    ("arms-budget-blocks-not-positions", A, "budget = blocks * block * bytes_per_token", "budget = blocks * bytes_per_token"),
    ("arms-no-cache-flag-missing", A, '        args.append("--no-prefix-cache")', "        pass"),
    ("arms-disk-budget-dropped", A, 'args += ["--kv-disk", disk_dir, "--kv-disk-budget", cfg.kv_disk_budget]', 'args += ["--kv-disk", disk_dir]'),
    ("arms-small-keeps-cfg-budget", A, "str(pool.budget_bytes) if small else cfg.kv_budget", "cfg.kv_budget"),
    ("arms-prefill-chunk-unchecked", A, 'if cfg.prefill_chunk and "--prefill-chunk" in options:', "if cfg.prefill_chunk:"),
    ("arms-missing-flag-runs", A, "if (flag := ARM_FLAGS[arm]) and flag not in options:", "if (flag := ARM_FLAGS[arm]) and False:"),
    ("arms-bpt-of-f16", A, "bpt = kv_bytes_per_token_of(cfg.model, kv)", 'bpt = kv_bytes_per_token_of(cfg.model, "f16")'),
    ("sparse-time-without-select", P, "total[name].append(t2 - t0)", "total[name].append(t2 - t1)"),
    ("sparse-warm-up-counted", P, "            if rnd:\n", "            if True:\n"),
    ("sparse-speedup-inverted", P, "1e6 * t, 1e6 * t_sel, dense / t))", "1e6 * t, 1e6 * t_sel, t / dense))"),
    ("sparse-torch-sel-drops-tail", P, "    nb = -(-ctx // BLOCK)\n", "    nb = ctx // BLOCK\n"),
    ("sparse-median-is-min", P, "return sorted(ts)[len(ts) // 2]", "return sorted(ts)[0]"),
    ("sparse-share-of-kernel", P, "return self.select_us / self.us_per_call", "return self.select_us / (self.us_per_call - self.select_us)"),
    ("sparse-budget-at-ctx", P, "            if b < ctx:\n", "            if b <= ctx:\n"),
    ("ls-ctv-f16", L, '"-ctk", t, "-ctv", t,', '"-ctk", t, "-ctv", "f16",'),
    ("ls-np-one", L, '"-np", str(parallel),', '"-np", "1",'),
    ("ls-not-executable-taken", L, "if found is None or not os.access(found, os.X_OK):", "if found is None:"),
    ("ls-gguf-unchecked", L, 'if gguf.suffix.lower() != ".gguf":', "if False:"),
    ("tour-f16-ratio-inverted", T, 'f16_mib = q8_mib * m["kvlens_kv_tokens_capacity"] / m["kvlens_kv_f16_tokens_same_bytes"]', 'f16_mib = q8_mib * m["kvlens_kv_f16_tokens_same_bytes"] / m["kvlens_kv_tokens_capacity"]'),
    ("tour-tokens-are-blocks", T, 'tokens = int(peaks["kvlens_kv_blocks_used"] * m["kvlens_kv_block_size"])', 'tokens = int(peaks["kvlens_kv_blocks_used"])'),
    ("tour-exit-code-ignored", T, "        if code != 0:\n", "        if False:\n"),
    ("tour-answers-not-temp0", T, "max_tokens=max_tokens, temperature=0", "max_tokens=max_tokens, temperature=1"),
    ("eng-one-step-short", E, "Request(f\"r{i}\", ids, steps + 2, stop_ids=frozenset())", "Request(f\"r{i}\", ids, steps + 1, stop_ids=frozenset())"),
    ("eng-warm-up-counted", E, "            if rnd:\n", "            if True:\n"),
    ("eng-first-kv-base-batch1", E, '("x_first_kv", by.get((first, r.batch)))', '("x_first_kv", by.get((first, 1)))'),
    ("eng-pool-not-whole-blocks", SCH, "blocks = sum(-(-(len(r.prompt_ids) + r.max_tokens) // BLOCK) for r in reqs)", "blocks = sum((len(r.prompt_ids) + r.max_tokens) // BLOCK for r in reqs)"),
    ("eng-loop-last-prompt", E, "rate = loop_round(llm, prompts[0], cfg.steps)", "rate = loop_round(llm, prompts[-1], cfg.steps)"),
    ("eng-row-is-best", E, "        return self.spread.median\n", "        return self.spread.high\n"),
    ("eng-dup-kv-allowed", E, "if len(set(self.kv)) < len(self.kv):", "if False:"),
    ("eng-probe-in-warm-up", E, "if rnd and probe is not None:", "if probe is not None:"),
    ("meter-machine-dropped", SP, "others, steal = max(named, machine),", "others, steal = named,"),
    ("meter-own-counted", SP, "machine = ((_busy_seconds() - self.busy0) - (_own_seconds() - self.own0)) / wall", "machine = (_busy_seconds() - self.busy0) / wall"),
    ("meter-gone-unlisted", SP, "        if machine - named >= 0.05:\n", "        if False:\n"),
    ("meter-children-counted", SP, "return t.user + t.system + t.children_user + t.children_system", "return t.user + t.system"),
    ("paired-ratio-mean", SP, "return statistics.median(x / y for x, y in zip(a, b, strict=True))", "return statistics.mean(x / y for x, y in zip(a, b, strict=True))"),
    ("notice-once-not-cached", N, "@functools.cache\ndef announce_compiles_once", "def announce_compiles_once"),
    ("lists-str-refused", C, "    if isinstance(value, str) and split is not None:\n        return split(value)\n", ""),
    ("lists-bool-taken", C, "integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)", "integral = isinstance(value, numbers.Integral)"),
    ("lists-float-for-int", C, "return integral or (kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool))", "return integral or isinstance(value, numbers.Real)"),
    ("lists-optional-ignored", C, "check_list(value, field, kind, field in optional, split if kind is str else None)", "check_list(value, field, kind, False, split if kind is str else None)"),
    ("lists-serve-unchecked", S, "        check_list_fields(self, kinds, optional=(\"concurrency\",), split=split_mode_list)\n", ""),
    ("lists-unit-unchecked", U, '        check_list_fields(self, {"seq_len": int, "amplitude": float}, optional=("amplitude",))\n', ""),
    ("eng-ratio-unpaired", E, "setattr(r, attr, paired_ratio(r.round_tok_s, base.round_tok_s, r.tok_s / base.tok_s))", "setattr(r, attr, r.tok_s / base.tok_s)"),
]

write_list(HERE / "benchserve35.json", BUGS)
