"""Write serve36.json: the fixes of the thirty-sixth session's hostile HTTP sweep (the sampler at its
limits and its faults, the request checks, HEAD, the bearer scheme, compressed bodies, the refused
field, tokenizing off the event loop, token bytes). Each bug's text must occur once and the planted
file must compile."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from planted_list import write_list  # noqa: E402

SA = "kvlens/engine/sampling.py"
SCH = "kvlens/engine/scheduler.py"
PR = "kvlens/serve/protocol.py"
APP = "kvlens/serve/app.py"
BL = "kvlens/serve/body_limit.py"
RUN = "kvlens/serve/runner.py"
TB = "kvlens/models/token_bytes.py"
TOK = "kvlens/models/tokenizer.py"
OUT = "kvlens/serve/output.py"

BUGS = [
    ("sample-max-not-subtracted", SA, "logits = (logits - logits.max()) / self.p.temperature", "logits = logits / self.p.temperature"),
    ("sample-float32", SA, "logits = logits.double().cpu()", "logits = logits.float().cpu()"),
    ("emit-sampler-unguarded", SCH, "        try:\n            tok = seq.sampler(logits)\n        except Exception as e:  # the sampler runs on this sequence's logits alone: it alone ends\n            return self._fail(seq, e, events)\n", "        tok = seq.sampler(logits)\n"),
    ("model-plain-str", PR, "    model: Text\n", "    model: str\n"),
    ("error-body-surrogate-kept", PR, 'message = message.encode("utf-8", "backslashreplace").decode("utf-8")', "message = message"),
    ("empty-body-as-missing", APP, "        if param is None:\n            return \"the request body is empty: it must be a JSON object\", None\n", ""),
    ("union-first-not-deepest", APP, 'return passed[0] if passed else max(same, key=lambda e: len(e.get("loc", ())))', "return passed[0] if passed else first"),
    ("token-ids-lax", PR, "TokenIds = list[Annotated[int, Strict()]]", "TokenIds = list[Annotated[int, Strict(False)]]"),
    ("batch-prompt-not-named", PR, "    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):", "    if False:"),
    ("health-get-only", APP, '@app.api_route("/health", methods=["GET", "HEAD"])', '@app.api_route("/health", methods=["GET"])'),
    ("models-get-only", APP, '@app.api_route("/v1/models", methods=["GET", "HEAD"],', '@app.api_route("/v1/models", methods=["GET"],'),
    ("bearer-case-sensitive", APP, 'if scheme.lower() != "bearer" or', 'if scheme != "Bearer" or'),
    ("bearer-any-scheme", APP, 'if scheme.lower() != "bearer" or', "if"),
    ("gzip-passed-through", BL, 'if encoding not in (b"", b"identity"):', "if False:"),
    ("gzip-not-counted", BL, "        self.on_refused(status)\n", ""),
    ("refused-always-prompt", RUN, "        if not isinstance(error, ContextOverflowError) or n_prompt >= room:", "        if True:"),
    ("refused-chat-max-tokens-name", RUN, 'return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"', 'return "max_tokens"'),
    ("overflow-message-bare", SCH, 'f"prompt {len(req.prompt_ids)} + max_tokens {req.max_tokens} = {e}"', 'f"{e}"'),
    ("completion-encode-on-loop", APP, "else await to_thread(llm.tokenizer.encode, body.prompt)", "else llm.tokenizer.encode(body.prompt)"),
    ("chat-encode-on-loop", APP, "ids = await to_thread(llm.tokenizer.encode, text, add_bos=False)", "ids = llm.tokenizer.encode(text, add_bos=False)"),
    ("encode-holds-gil", TOK, "ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids", "ids = self._tok.encode(text, add_special_tokens=False).ids"),
    ("byte-table-shifted", TB, "table.update({chr(256 + i): b for i, b in enumerate(moved)})", "table.update({chr(257 + i): b for i, b in enumerate(moved)})"),
    ("byte-added-mapped", TB, "        if token_id in added:  # matched whole in the text, never byte-mapped", "        if False:"),
    ("byte-fallback-as-text", TB, "            byte = _BYTE_TOKEN.fullmatch(piece)", "            byte = None"),
    ("byte-space-not-replaced", TB, "                piece = piece.replace(pattern, content)", "                pass"),
    ("chat-bytes-from-text", OUT, '"bytes": None if raw is None else list(raw)}', '"bytes": list(tok.decode([token_id]).encode())}'),
]

# after the first run: the body's idle timeout (added later in the session)
BODY_STALL = [
    ("stall-not-timed", BL, "return await asyncio.wait_for(receive(), self.idle_timeout_s)", "return await receive()"),
    ("stall-drain-not-timed", BL, "            message = await self._next(receive)\n            if message[\"type\"] != \"http.request\" or not", "            message = await receive()\n            if message[\"type\"] != \"http.request\" or not"),
    ("stall-not-answered", BL, "        except _Stalled:\n            await self._answer(", "        except _Stalled:\n            return\n            await self._answer("),
]

if __name__ == "__main__":
    write_list(HERE / "serve36.json", BUGS)
    write_list(HERE / "serve36-stall.json", BODY_STALL)
