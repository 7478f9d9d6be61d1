"""Write edges36.json: the fixes of the thirty-sixth session's hostile CLI and API sweep (special files,
the backend against the KV mode, the engine's edges, verify's record fields, the sweep store, config
lists, parse-time options, the API's TypeErrors, the lab's inputs). Each bug's text must occur once
and the planted file must compile."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from planted_list import write_list  # noqa: E402

C = "kvlens/checks.py"
CFG = "kvlens/models/config.py"
PLAN = "kvlens/lab/plan.py"
SPEC = "kvlens/lab/sweep_spec.py"
SCH = "kvlens/engine/scheduler.py"
GEN = "kvlens/engine/generate.py"
ATT = "kvlens/engine/attention.py"
LLM = "kvlens/engine/llm.py"
VER = "kvlens/engine/verify.py"
STORE = "kvlens/lab/store.py"
REP = "kvlens/lab/sweep_report.py"
DEC = "kvlens/bench/decode.py"
CLI = "kvlens/cli.py"
CB = "kvlens/cli_bench.py"
UNIT = "kvlens/lab/unit.py"
NEEDLE = "kvlens/lab/needle.py"

BUGS = [
    ("fifo-json-opened", C, "    check_not_special(path, error, what)\n    try:", "    try:"),
    ("fifo-model-opened", CFG, "    check_not_special(path, ModelLoadError)\n", ""),
    ("fifo-plan-opened", PLAN, "        check_not_special(path, ValueError)\n", ""),
    ("fifo-spec-opened", SPEC, '    check_not_special(p, SpecError, "the sweep spec")\n', ""),
    ("fifo-is-fine", C, "(stat.S_ISFIFO, \"a FIFO (named pipe)\"), ", ""),
    ("engine-backend-unchecked", SCH, "        check_backend_mode(llm.attn_backend, llm.kv)  # before any request: not at its first step\n", ""),
    ("generate-echo-first", GEN, "    check_backend_mode(llm.attn_backend, llm.kv)  # what the engine checks, before the prompt is echoed\n", ""),
    ("mode-packed-passes", ATT, "    kind = next((kind for pair in pairs for kind in pair if kind.packed), None)", "    kind = None"),
    ("mode-heads-ignored", ATT, "    return pairs + [pair for i in layers for pair in mode.head_kinds(i) or ()]", "    return pairs"),
    ("pool-alloc-raw", SCH, "        except RuntimeError as e:  # the allocator's refusal: the budget is more than this machine has", "        except KeyError as e:  # the allocator's refusal: the budget is more than this machine has"),
    ("flags-unchecked", SCH, "            check_bool(getattr(self, name), name)", "            pass"),
    ("config-type-unchecked", SCH, "        if not isinstance(config, EngineConfig):", "        if False:"),
    ("fitted-before-check", SCH, "    blocks = sum(-(-check_request(llm, r) // BLOCK) for r in reqs)", "    blocks = sum(-(-(len(r.prompt_ids) + r.max_tokens) // BLOCK) for r in reqs)"),
    ("record-fields-unread", VER, "        _RecordFields.model_validate(record)\n", "        pass\n"),
    ("record-any-version", VER, "    record_version: Literal[1] = RECORD_VERSION", "    record_version: int = RECORD_VERSION"),
    ("record-ids-not-int32", VER, "TokenId = Annotated[int, Strict(), Field(ge=0, le=2**31 - 1)]", "TokenId = Annotated[int, Strict(), Field(ge=0)]"),
    ("store-foreign-written", STORE, '        if tables and "meta" not in tables:', "        if False:"),
    ("store-empty-report", STORE, "        if not tables and not create:", "        if False:"),
    ("report-creates", REP, "    with Store(db, create=False) as store:", "    with Store(db) as store:"),
    ("list-empty-ok", C, "        if items is not None and not items and field not in may_be_empty:", "        if False:"),
    ("list-twice-ok", C, "        if twice is not None:", "        if False:"),
    ("decode-no-pair-ok", DEC, "        if not any(backend_reads(b, m) for b in self.attn_backend for m in self.kv):", "        if False:"),
    ("graceful-unchecked", CLI, '        help="On SIGTERM: seconds in-flight requests get to finish.",\n        callback=cb.finite_option(minimum=0),', '        help="On SIGTERM: seconds in-flight requests get to finish.",'),
    ("bench-rate-inf", CB, 'callback=cb.finite_option(minimum=0.001)', "min=0.001"),
    ("backend-none-attr", ATT, "    if not isinstance(backend, str):\n        raise TypeError", "    if False:\n        raise TypeError"),
    ("cache-type-unchecked", LLM, "        if not isinstance(cache, (KVCache, PagedKV)):", "        if False:"),
    ("settings-unchecked", LLM, "        _check_settings(self.cache_options, self.sparse)\n", ""),
    ("unit-dist-inf", UNIT, "        if not 0 < value <= MAX_AMPLITUDE:  # nan fails too", "        if not 0 < value:  # nan fails too"),
    ("unit-seed-unbounded", UNIT, "maximum=(2**64 - 1) // 7919 - self.trials - 1", "maximum=None"),
    ("needle-names-prompt-share", NEEDLE, "    n_filler = ctx - reserved - len(fact) - len(question) - len(bos)", "    ctx -= reserved\n    n_filler = ctx - len(fact) - len(question) - len(bos)"),
]

# the last three fixes of the session
LATE = [
    ("kld-budget-inf", PLAN, 'self.kld_budget = check_float(self.kld_budget, "--kld-budget", above=0.0)', "pass"),
    ("plan-chunks-unchecked", PLAN, 'check_counts(self, "ctx", "calib_chunks")', "pass"),
    ("spec-budget-nan", SPEC, 'if not all(0 < b < math.inf for b in s["budgets"]):', 'if any(b <= 0 for b in s["budgets"]):'),
    ("cache-dir-errno", "kvlens/corpus.py", "    if root.exists() and not root.is_dir():", "    if False:"),
]

# the lab configs' counts (the last fix of the session)
COUNTS = [
    ("ppl-ctx-unchecked", "kvlens/lab/ppl.py", '        check_counts(self, "ctx", minimum=4)  # half of it is context, half is scored\n', ""),
    ("greedy-tokens-unchecked", "kvlens/lab/greedy.py", '        check_counts(self, "tokens", minimum=None)  # an int (the range is said below)\n', ""),
    ("layers-unchecked", "kvlens/lab/layers.py", '        check_counts(self, "ctx", "chunks")\n', "        pass\n"),
    ("modes-empty-list", "kvlens/lab/common.py", "        if not spec:  # a run of no mode would return no rows", "        if False:"),
    ("counts-check-nothing", "kvlens/lab/common.py", '        check_int(getattr(config, name), f"--{name.replace(\'_\', \'-\')}", minimum=minimum)', "        pass"),
]

if __name__ == "__main__":
    write_list(HERE / "edges36.json", BUGS)
    write_list(HERE / "late36.json", LATE)
    write_list(HERE / "counts36.json", COUNTS)
