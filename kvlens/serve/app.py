"""The FastAPI application: OpenAI-compatible completions and chat completions, health, metrics.

Every 4xx carries OpenAI's error body (FastAPI's own validation errors and malformed JSON
included); every completion carries the engine's verifiable record under ``"kvlens"``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool as to_thread
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.llm import LLM
from ..engine.serving import Engine
from ..models.spm_spelling import UnspellableTextError
from .async_engine import AsyncEngine
from .body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from .metrics import ServeMetrics
from .output import chat_logprobs, completion_logprobs
from .protocol import APIError, ChatRequest, CompletionRequest, envelope, error_body, new_id, usage
from .runner import EngineFault, Job, Runner

log = logging.getLogger("kvlens.serve")


@dataclass(frozen=True)
class AppConfig:
    model_name: str  # the id clients send as "model"
    api_key: str | None = None  # set: /v1/* needs "Authorization: Bearer <key>"
    retry_after_s: int = 1  # Retry-After of a 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is a 413 (serve/body_limit.py)


_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _branch_tag(part: Any) -> bool:
    """Whether a ``loc`` element names the branch of a union pydantic tried ("str", "list[int]",
    "function-after[...]"), not a field: OpenAI's param is the field path alone."""
    return str(part) in _BRANCH_TAGS or "[" in str(part)


def _field_path(error: dict) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body" and not _branch_tag(p)]


def _first_error(errors: list) -> dict:
    """The first error; where that is one branch of a union failing on the input's type (a list of chat
    content parts is not a str), the same field's error from a branch the input's type passed, or, where
    none passed, from the branch that read deepest (a content part's ``text`` that is null)."""
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    tag = next((i for i, p in enumerate(loc) if _branch_tag(p)), None)
    if tag is None or not str(first.get("type", "")).endswith("_type"):
        return first
    same = [e for e in errors if tuple(e.get("loc", ()))[:tag] == loc[:tag]]
    passed = [e for e in same if not str(e.get("type", "")).endswith("_type")]
    # else every branch failed on a type: the one that got furthest into the input says where
    return passed[0] if passed else max(same, key=lambda e: len(e.get("loc", ())))


def _validation_message(
    exc: RequestValidationError, content_type: str = "application/json"
) -> tuple[str, str | None]:
    first = _first_error(exc.errors())
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(_field_path(first)) or None
    kind, msg = first.get("type", ""), str(first.get("msg", "invalid request"))
    if param is None and tuple(first.get("loc", ())) == ("body",) and kind.endswith("_type"):
        # not an object: a JSON array or string, or a body FastAPI did not read as JSON at all
        sent = (
            "" if "json" in content_type.lower() else f" (it was sent as {content_type or 'no Content-Type'})"
        )
        return f"the request body must be a JSON object sent as Content-Type: application/json{sent}", None
    if kind == "value_error" and isinstance(first.get("ctx", {}).get("error"), ValueError):
        msg = str(first["ctx"]["error"])  # our validator's own words, without pydantic's "Value error, "
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        if param is None:
            return "the request body is empty: it must be a JSON object", None
        return f"missing required field: {param}", param
    return (f"{param}: {msg}" if param else msg), param


def _install_error_handlers(app: FastAPI, metrics: ServeMetrics) -> None:
    def answer(status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.errors.labels(str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return answer(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        return answer(400, error_body(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return answer(exc.status_code, error_body(str(exc.detail), kind), getattr(exc, "headers", None))

    @app.exception_handler(EngineFault)
    async def _fault(_: Request, exc: EngineFault) -> JSONResponse:
        return answer(500, error_body(str(exc), "server_error"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return answer(500, error_body(f"internal error: {type(exc).__name__}", "server_error"))


async def _encode(llm: LLM, text: str, param: str, add_bos: bool | None = None) -> list[int]:
    """The ids of ``text``, tokenized off the event loop (a long prompt takes seconds, and the server
    answers others meanwhile); a text the vocabulary cannot spell is the request's fault."""
    try:
        return await to_thread(llm.tokenizer.encode, text, add_bos)
    except UnspellableTextError as e:
        raise APIError(400, str(e), param=param) from None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Shapes:
    """How each endpoint spells its choices (full response and stream chunks)."""

    def __init__(self, runner: Runner, chat: bool, model: str) -> None:
        self.runner, self.chat, self.model = runner, chat, model
        self.kind = "chat.completion" if chat else "text_completion"
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def _logprobs(self, job: Job, start: int = 0) -> dict[str, Any] | None:
        if job.request.logprobs is None:
            return None
        fmt = chat_logprobs if self.chat else completion_logprobs
        return fmt(self.runner.llm.tokenizer, job.out.logprobs[start:])

    def full(self, job: Job, text: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": job.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(job)
        return {
            **envelope(self.kind, job.rid, self.model, int(time.time())),
            "choices": [choice],
            "usage": usage(job.prompt_tokens, job.completion_tokens, job.cached_tokens),
            "kvlens": job.record,
        }

    def chunk(self, job: Job, created: int, text: str | None, lp_from: int, last: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self._logprobs(job, lp_from) if text is not None else None
        choice["finish_reason"] = job.finish_reason if last else None
        out = {**envelope(self.chunk_kind, job.rid, self.model, created), "choices": [choice]}
        if last:
            out["kvlens"] = job.record
        return out

    async def stream(self, job: Job, include_usage: bool) -> AsyncIterator[str]:
        created, lp_from = int(time.time()), 0
        if self.chat:
            yield _sse(self.chunk(job, created, None, 0, False))
        try:
            async for piece in self.runner.run(job):
                if job.finish_reason is None:
                    yield _sse(self.chunk(job, created, piece, lp_from, False))
                    lp_from = len(job.out.logprobs)
                else:  # the last piece rides on the final chunk
                    yield _sse(self.chunk(job, created, piece, lp_from, True))
                    lp_from = -1
            if lp_from >= 0:
                yield _sse(self.chunk(job, created, "", lp_from, True))
        except EngineFault as e:
            yield _sse(error_body(str(e), "server_error"))
        if include_usage:
            yield _sse(
                {
                    **envelope(self.chunk_kind, job.rid, self.model, created),
                    "choices": [],
                    "usage": usage(job.prompt_tokens, job.completion_tokens, job.cached_tokens),
                }
            )
        yield "data: [DONE]\n\n"


def _authorizer(api_key: str | None) -> Callable[[Request], None]:
    """The endpoints' dependency: with an API key, a request must carry it as a Bearer token."""

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110 §11.1); the key is compared in constant time
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    return authorize


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(
            404, f"The model '{name}' does not exist; this server has '{served}'",
            code="model_not_found", param="model",
        )  # fmt: skip


def build_app(llm: LLM, engine: Engine, config: AppConfig) -> FastAPI:
    """The server around an engine; the engine thread runs for the app's lifespan."""
    aengine = AsyncEngine(engine)
    metrics = ServeMetrics(aengine.stats, lambda: aengine.faults)
    runner = Runner(llm, aengine, metrics, config.retry_after_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        await aengine.stop()

    app = FastAPI(title="kvlens", lifespan=lifespan)
    _install_error_handlers(app, metrics)
    app.add_middleware(
        BodyLimit,
        max_bytes=config.max_body_bytes,
        on_refused=lambda status: metrics.errors.labels(str(status)).inc(),
    )

    authorize = _authorizer(config.api_key)

    async def respond(request: Request, shapes: _Shapes, job: Job, body: Any) -> Response:
        if body.stream:
            return StreamingResponse(shapes.stream(job, body.include_usage), media_type="text/event-stream")
        text = await runner.collect(job, request.is_disconnected)
        return JSONResponse(shapes.full(job, text))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        ok = aengine.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/v1/models", methods=["GET", "HEAD"], dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "kvlens"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model, config.model_name)
        ids = (
            list(body.prompt) if isinstance(body.prompt, list) else await _encode(llm, body.prompt, "prompt")
        )
        job = await runner.submit("completions", new_id("cmpl"), ids, body.max_tokens, body, body.logprobs)
        return await respond(request, _Shapes(runner, False, config.model_name), job, body)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatRequest, request: Request) -> Response:
        _check_model(body.model, config.model_name)
        messages = [m.for_template() for m in body.messages]
        try:  # the template writes any BOS itself
            text = await to_thread(llm.tokenizer.apply_chat_template, messages)
        except Exception as e:  # no template, or the template refuses the conversation
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        ids = await _encode(llm, text, "messages", add_bos=False)
        job = await runner.submit("chat", new_id("chatcmpl"), ids, body.token_limit, body, body.logprobs_top)
        return await respond(request, _Shapes(runner, True, config.model_name), job, body)

    return app
