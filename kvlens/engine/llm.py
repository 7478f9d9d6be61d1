"""The engine: a loaded model plus its KV-cache mode; chunked prefill, decode loop, generation."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from ..checks import check_bool, check_int, check_tensor, check_text, check_token_ids
from ..kernels.attend_step import AttendStep
from ..kernels.threads import decode_threads
from ..kv.blocks import SparseConfig
from ..kv.cache import BLOCK, KVCache, check_fits_model
from ..kv.modes import MODES, CacheOptions, KVMode
from ..kv.pool import PagedKV
from ..models.loader import LoadedModel
from ..models.transformer import Transformer
from ..models.weights import step_read_bytes
from .attention import check_backend_head_dim, check_sparse_cache, make_attend, resolve_backend
from .fused_step import forward_fused, fused_decoder
from .sampling import Sampler, SamplingParams
from .sequence import Request

DEFAULT_PREFILL_CHUNK = 512


VARIANT_SETTINGS = ("kv", "attn_backend", "cache_options", "prefill_chunk", "sparse", "fused_step")


class ContextOverflowError(ValueError):
    """The prompt (plus the tokens asked for) does not fit in the model's context."""


def check_settings(
    attn_backend: str, cache_options: object, prefill_chunk: int, sparse: object, device: torch.device
) -> str:
    """An :class:`LLM`'s own settings, checked where they are given: ``kvlens.load`` checks them before
    it reads the model (a typo cost a whole load before), ``LLM`` when it is built or varied. The
    settings of kvlens' own types failed at the first forward when given a string. Returns the
    backend that runs (``auto`` resolved for ``device``)."""
    backend = resolve_backend(attn_backend, device)
    check_int(prefill_chunk, "prefill_chunk", minimum=1)
    if not isinstance(cache_options, CacheOptions):
        raise TypeError(f"cache_options must be a CacheOptions, got {type(cache_options).__name__}")
    if sparse is not None and not isinstance(sparse, SparseConfig):
        raise TypeError(f"sparse must be a SparseConfig or None, got {type(sparse).__name__}")
    return backend


class LLM:
    """A model ready to run with a given KV-cache mode (``kv``: a name or a :class:`KVMode`), cache
    options and attention backend."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv: str | KVMode = "q8",
        attn_backend: str = "auto",
        cache_options: CacheOptions | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        sparse: SparseConfig | None = None,
    ) -> None:
        if not isinstance(loaded, LoadedModel):
            raise TypeError(f"LLM takes a LoadedModel (kvlens.load builds one), got {type(loaded).__name__}")
        self.kv = KVMode.parse(kv)
        self.cache_options = cache_options or CacheOptions()
        self.sparse = sparse  # sparse decode policy (None: dense); caches then track block bounds
        backend = check_settings(
            attn_backend, self.cache_options, prefill_chunk, sparse, loaded.weights.embed.device
        )
        self.config, self.tokenizer, self.source = loaded.config, loaded.tokenizer, loaded.source
        self.loaded = loaded  # the model file's digest (verifiable records) is cached on it
        self.weights_mode = loaded.weights_mode
        cfg = loaded.config
        self.attn_backend = backend
        self._check_fits_model()
        self.model = Transformer(loaded.config, loaded.weights)
        self.device = self.model.device
        self.prefill_chunk = prefill_chunk
        self.fused = fused_decoder(self.model)  # one compiled call per layer (None: the model has none)
        self.fused_step = True  # one-token steps as one compiled call per layer where they can (False: never)
        # else a layer's attention (its KV write included) as one compiled call, on the CPU
        on_cpu = self.device.type == "cpu"
        self._attend_step = AttendStep(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) if on_cpu else None
        windows = [w for w in loaded.config.layer_windows if w is not None]
        self._window_free = min(windows, default=loaded.config.max_ctx)  # positions every layer attends whole

    # -- cache and forward -------------------------------------------------------------------
    def new_cache(
        self, capacity: int, kv: str | KVMode | None = None, options: CacheOptions | None = None
    ) -> KVCache:
        """An empty cache for ``capacity`` positions: mode ``kv`` (default: the engine's) and ``options``
        (default: the engine's). With sparse decode on, the cache tracks block bounds."""
        mode = self.kv if kv is None else KVMode.parse(kv)
        options = self.cache_options if options is None else options
        if self.sparse is not None and not options.track_blocks:
            options = dataclasses.replace(options, track_blocks=True)
        cfg = self.config
        return KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity, mode, self.device, options)

    def check_ids(self, ids: list[int] | torch.Tensor) -> list[int]:
        """``ids`` as a non-empty list of ints in [0, vocab); TypeError/ValueError otherwise."""
        return check_token_ids(ids, self.config.vocab)

    def check_fits(self, n_tokens: int) -> None:
        if check_int(n_tokens, "n_tokens", minimum=0) > self.config.max_ctx:
            raise ContextOverflowError(
                f"{n_tokens} tokens do not fit in the model's context of {self.config.max_ctx} tokens"
            )

    def _check_decode_args(self, n_before: int, max_new_tokens: int, sampling: SamplingParams | None) -> None:
        """The arguments of a decode after ``n_before`` positions: a count ≥ 0 of new tokens that fits in
        the context, and a SamplingParams or None."""
        check_int(max_new_tokens, "max_new_tokens", minimum=0)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        self.check_fits(n_before + max_new_tokens)

    def _check_cache(self, cache: KVCache | PagedKV) -> None:
        """TypeError unless ``cache`` is a KV cache; ValueError unless it is this model's shape."""
        if not isinstance(cache, (KVCache, PagedKV)):
            raise TypeError(f"cache must be a KVCache (LLM.new_cache), got {type(cache).__name__}")
        check_fits_model(cache, self.config.n_layers, self.config.n_kv_heads, self.config.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        ids: list[int] | torch.Tensor,
        cache: KVCache,
        start: int,
        prefill: bool = True,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Run tokens at positions start.. through the model, writing the cache; returns hidden [n, hidden]."""
        ids = torch.as_tensor(self.check_ids(ids), dtype=torch.long, device=self.device)
        check_bool(prefill, "prefill")
        backend = self.attn_backend if backend is None else resolve_backend(backend, self.device)
        self._check_cache(cache)
        if check_int(start, "start", minimum=0) > cache.length:
            raise ValueError(
                f"start {start} is past the {cache.length} positions the cache holds: attention would read "
                f"positions {cache.length}..{start - 1}, which were never written"
            )
        self.check_fits(start + ids.shape[0])
        sparse = None if prefill else self.sparse
        check_sparse_cache(sparse, cache)  # before the fused step, which runs dense
        if not prefill and ids.shape[0] == 1 and self.fused_step and self.fused is not None:
            with self.step_threads(True):
                hidden = self.forward_fused(ids, cache, start, backend)
            if hidden is not None:
                return hidden
        attend = make_attend(
            cache,
            prefill,
            backend,
            self.config.layer_windows,
            sparse,
            self.model.profiler,
            self.attend_step,
        )
        with self.step_threads(not prefill):
            return self.model.forward(ids, start, attend)

    def forward_fused(
        self, ids: torch.Tensor, cache: KVCache | PagedKV, start: int, backend: str
    ) -> torch.Tensor | None:
        """Hidden state [1, hidden] of one token (``ids [1]``) at ``start`` with each layer one compiled
        call, or None where that path does not apply (:func:`kvlens.engine.fused_step.forward_fused`)."""
        if not self.fused_step or self.fused is None:
            return None
        return forward_fused(self.model, self.fused, ids, cache, start, backend, self._window_free)

    @property
    def attend_step(self) -> AttendStep | None:
        """The compiled one-call attention of decode steps (engine.attention.make_attend's ``step``), or
        None: off the CPU, or with ``fused_step`` False (every call unfused)."""
        return self._attend_step if self.fused_step else None

    @property
    def step_weight_bytes(self) -> int:
        """The weight bytes one decode step reads (:func:`kvlens.models.weights.step_read_bytes`)."""
        return step_read_bytes(self.model.w)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of final hidden states [n, hidden] (what :meth:`forward` returns)."""
        check_tensor(hidden, "hidden", floating=True, shape=(None, self.config.hidden))
        with self.step_threads(hidden.shape[0] == 1):
            return self.model.logits(hidden)

    def step_threads(self, decode: bool) -> AbstractContextManager:
        """A decode step on CPU runs on the cores other processes leave free (kernels/threads.py); the
        serving engine's steps enter it too (ModelRunner.decode). Not to be nested."""
        return decode_threads() if decode and self.device.type == "cpu" else nullcontext()

    def variant(self, **changes) -> LLM:
        """The same loaded model with other engine settings (kv, sparse, attn_backend, ...), weights shared."""
        other = copy.copy(self)
        for name, value in changes.items():
            if name not in VARIANT_SETTINGS:
                raise TypeError(
                    f"LLM has no setting {name!r} (variant changes {', '.join(VARIANT_SETTINGS)})"
                )
            setattr(other, name, value)
        check_bool(other.fused_step, "fused_step")
        other.attn_backend = check_settings(
            other.attn_backend, other.cache_options, other.prefill_chunk, other.sparse, other.device
        )
        other.kv = KVMode.parse(other.kv)
        other._check_fits_model()
        return other

    def _check_fits_model(self) -> None:
        """What the KV mode and backend need of the model, checked where an LLM is built or varied: a
        recipe's layer and KV-head counts, an integer backend's head_dim."""
        cfg = self.config
        self.kv.check_layout(cfg.n_layers, cfg.head_dim, cfg.n_kv_heads)
        check_backend_head_dim(self.attn_backend, cfg.head_dim)

    def prefill(
        self,
        ids: list[int],
        cache: KVCache,
        chunk: int | None = None,
        start: int = 0,
        on_hidden: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Prefill in chunks: each chunk attends every earlier position through the cache.

        Returns the last position's logits; ``on_hidden(chunk_start, hidden)`` sees every chunk.
        """
        ids = self.check_ids(ids)
        chunk = self.prefill_chunk if chunk is None else check_int(chunk, "chunk", minimum=1)
        hidden = None
        for s in range(0, len(ids), chunk):
            hidden = self.forward(ids[s : s + chunk], cache, start + s, prefill=True)
            if on_hidden is not None:
                on_hidden(start + s, hidden)
        return self.lm_head(hidden[-1:])[0]

    @torch.inference_mode()
    def logits(
        self,
        ids: list[int],
        kv: str | KVMode | None = None,
        prefill_chunk: int | None = None,
        options: CacheOptions | None = None,
    ) -> torch.Tensor:
        """Logits [len(ids), vocab] for a fresh cache, prefilling in chunks of ``prefill_chunk``."""
        ids = self.check_ids(ids)
        self.check_fits(len(ids))
        cache = self.new_cache(len(ids), kv, options)
        out: list[torch.Tensor] = []
        self.prefill(ids, cache, prefill_chunk, on_hidden=lambda _s, h: out.append(self.lm_head(h)))
        return torch.cat(out)

    # -- generation --------------------------------------------------------------------------
    @torch.inference_mode()
    def generate_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop_at_eos: bool = True,
        cache: KVCache | None = None,
        prefill_chunk: int | None = None,
    ) -> Iterator[int]:
        """Yield new token ids one by one: chunked prefill (chunks of ``prefill_chunk``, default the
        engine's), then one-token decode steps.

        Runs as a batch of one through the serving engine (:mod:`kvlens.engine.scheduler`), so a
        request alone and the same request among others are one computation (batch invariance).
        Given a ``cache``, or with what the paged pool does not implement (sparse decode, the lab's
        keep-sink / keep-recent options, a recipe's sink over one block), it runs this LLM's own loop
        over a contiguous cache instead."""
        prompt_ids = self.check_ids(prompt_ids)
        self._check_decode_args(len(prompt_ids), max_new_tokens, sampling)
        check_bool(stop_at_eos, "stop_at_eos")
        if cache is not None or not self.servable:
            cache = cache or self.new_cache(len(prompt_ids) + max_new_tokens)
            logits = self.prefill(prompt_ids, cache, prefill_chunk)
            yield from self.decode(cache, logits, len(prompt_ids), max_new_tokens, sampling, stop_at_eos)
            return
        if max_new_tokens == 0:
            return
        from .scheduler import run_alone

        llm = (
            self if prefill_chunk in (None, self.prefill_chunk) else self.variant(prefill_chunk=prefill_chunk)
        )
        stop = None if stop_at_eos else frozenset()
        req = Request("0", prompt_ids, max_new_tokens, sampling or SamplingParams(), stop)
        for event in run_alone(llm, req):
            yield event.token_id

    @property
    def servable(self) -> bool:
        """Whether the serving engine can run this LLM: dense decode, none of the lab's kept positions
        (keep-sink / keep-recent options), a recipe's sink of one block at most (its paged pool)."""
        options = self.cache_options
        return (
            self.sparse is None
            and not (options.keeps_exact or options.keep_sink)
            and self.kv.keep_sink <= BLOCK
        )

    @torch.inference_mode()
    def decode(
        self,
        cache: KVCache,
        logits: torch.Tensor,
        pos: int,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_at_eos: bool = True,
    ) -> Iterator[int]:
        """Decode after a prefill: ``logits`` of the last prompt position, ``pos`` = prompt length."""
        self._check_cache(cache)
        self._check_decode_args(check_int(pos, "pos", minimum=0), max_new_tokens, sampling)
        if pos > cache.length:
            raise ValueError(f"pos {pos} is past the {cache.length} positions the cache holds")
        check_bool(stop_at_eos, "stop_at_eos")
        check_tensor(logits, "logits", floating=True, shape=(self.config.vocab,), no_nan=True)
        if not bool(torch.isfinite(logits).any()):  # all masked: no token to choose
            raise ValueError("logits has no finite entry")
        sample = Sampler(sampling or SamplingParams())
        for i in range(max_new_tokens):
            tok = sample(logits)
            yield tok
            if (stop_at_eos and tok in self.tokenizer.eos_ids) or i == max_new_tokens - 1:
                return
            hidden = self.forward([tok], cache, pos, prefill=False)
            logits = self.lm_head(hidden)[0]
            pos += 1

    def generate_batch(
        self,
        prompts: list[str],
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        chat: bool = False,
    ) -> list[str]:
        """Continuations of every prompt, in order, run together through the serving engine (each
        output is what :meth:`generate` gives for that prompt alone). A seeded ``sampling`` seeds every
        request's own generator with that seed."""
        from .scheduler import run_batch

        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of strings")
        check_int(max_new_tokens, "max_new_tokens", minimum=1)
        reqs = [
            Request(str(i), self.encode_prompt(p, chat), max_new_tokens, sampling or SamplingParams())
            for i, p in enumerate(prompts)
        ]
        outputs = run_batch(self, reqs)
        eos = self.tokenizer.eos_ids
        return [self.tokenizer.decode([t for t in outputs[r.request_id] if t not in eos]) for r in reqs]

    def encode_prompt(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        check_text(prompt)
        if system is not None:
            check_text(system, "system")
        if check_bool(chat, "chat"):
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            # The template writes any BOS itself.
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_bos=False)
        return self.tokenizer.encode(prompt)

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        chat: bool = False,
        sampling: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> str:
        """Generate a continuation of ``prompt`` (greedy unless ``sampling`` says otherwise)."""
        if on_text is not None and not callable(on_text):
            raise TypeError(f"on_text must be a callable or None, got {type(on_text).__name__}")
        ids = self.encode_prompt(prompt, chat)
        stream = self.tokenizer.stream_decoder()
        pieces = []
        for tok in self.generate_ids(ids, max_new_tokens, sampling):
            if tok in self.tokenizer.eos_ids:
                break
            piece = stream.push(tok)
            pieces.append(piece)
            if on_text and piece:
                on_text(piece)
        tail = stream.flush()
        if on_text and tail:
            on_text(tail)
        return "".join(pieces) + tail

    # -- lab hooks ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_qkv(
        self, ids: list[int], layers: Sequence[int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Exact post-RoPE (Q [H, n, d], K [KV, n, d], V [KV, n, d]) of each of ``layers`` (default:
        every layer), in that order, from one forward pass of the prompt through an f32 cache."""
        ids = self.check_ids(ids)
        n_layers = self.config.n_layers
        if layers is not None and not isinstance(layers, Sequence):
            raise TypeError(f"layers must be a sequence of layer indices, got {type(layers).__name__}")
        wanted = list(range(n_layers)) if layers is None else list(layers)
        for i in wanted:
            check_int(i, "layer", minimum=0, maximum=n_layers - 1)
        self.check_fits(len(ids))
        cache = self.new_cache(len(ids), MODES["f32"], CacheOptions())
        inner = make_attend(cache, True, "torch", self.config.layer_windows)
        captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
            if i in wanted:
                captured[i] = (q.clone(), k.clone(), v.clone())
            return inner(i, q, k, v, start)

        self.model.forward(torch.as_tensor(ids, dtype=torch.long, device=self.device), 0, attend)
        return [captured[i] for i in wanted]
