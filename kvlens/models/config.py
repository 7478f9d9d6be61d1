"""Model configuration shared by the loaders and the transformer.

Every count and constant is checked when a :class:`ModelConfig` is built (positive, finite,
consistent), so a config.json or GGUF header that does not add up is refused before any weight is
read; the loaders read each key through :func:`read_key`, which names the key in its error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import check_float, check_instance, check_int, check_not_special


class ModelLoadError(ValueError):
    """A model file or directory that is missing, truncated, corrupt, inconsistent or unsupported."""


# Architectures the transformer implements, with the features each one switches on.
ARCHITECTURES = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "gemma3": {"qkv_bias": False, "qk_norm": True},  # GGUF only (its norms stored as 1 + w)
}
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's activation of the gate
# RoPE scaling kinds the transformer implements, with the numbers each one needs.
ROPE_SCALING = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_scaling_kind(scaling: Mapping[str, Any] | None) -> Any:
    """The RoPE scaling a config's dict names: ``rope_type``, or its older name ``type`` (as
    transformers reads it); "default" where neither is given."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


_COUNTS = ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab", "max_ctx")
REQUIRED = object()


def read_key(
    source: Mapping[str, Any], key: str, where: str, check: Callable[[Any, str], Any], default: Any = REQUIRED
) -> Any:
    """``check(source[key])``, or ``default`` when absent; a bad or missing value names ``key``."""
    value = source.get(key)
    if value is None:
        if default is REQUIRED:
            raise ModelLoadError(f"{where} lacks {key}")
        return default
    try:
        return check(value, f"{where}: {key}")
    except (TypeError, ValueError) as e:
        raise ModelLoadError(str(e)) from None


def count(value: Any, name: str) -> int:
    return check_int(value, name, minimum=1)


def positive(value: Any, name: str) -> float:
    return check_float(value, name, above=0.0)


def non_negative(value: Any, name: str) -> int:
    """A :func:`read_key` check of a count or index that may be 0 (a layer index, a window of 0)."""
    return check_int(value, name, minimum=0)


@dataclass
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_ctx: int = 4096
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = (
        None  # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8, ...}
    )
    sliding_window: int | None = None
    # Gemma-3: every sliding_pattern-th layer is global, the others windowed (None: all windowed),
    # windowed layers rotate with rope_local_theta (None: rope_theta).
    sliding_pattern: int | None = None
    rope_local_theta: float | None = None
    window_layers: tuple[int, ...] | None = None  # the windowed layers (Qwen2/3); None: by the above
    hidden_act: str = "silu"
    embed_scale: float = 1.0  # Gemma multiplies the embedding rows by sqrt(hidden)
    sandwich_norms: bool = False  # Gemma: post-attention and post-MLP norms before each residual add
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # field -> the key it was read from (config.json / GGUF), so errors name what the user can see
    keys: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.arch!r}; kvlens implements: {', '.join(ARCHITECTURES)}"
            )
        try:
            self._check()
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"inconsistent model config: {e}") from None

    def _label(self, name: str) -> str:
        key = self.keys.get(name, name)
        return name if key == name else f"{name} ({key})"

    def _check(self) -> None:
        for name in _COUNTS:
            count(getattr(self, name), self._label(name))
        self.rope_theta = positive(self.rope_theta, self._label("rope_theta"))
        self.rms_eps = positive(self.rms_eps, self._label("rms_eps"))
        if self.sliding_window is not None:
            count(self.sliding_window, self._label("sliding_window"))
        if self.sliding_pattern is not None:
            count(self.sliding_pattern, self._label("sliding_pattern"))
        if self.window_layers is not None:
            for i in self.window_layers:
                check_int(i, "window_layers[]", minimum=0, maximum=self.n_layers - 1)
        for name in ("rope_local_theta", "query_pre_attn_scalar"):
            if getattr(self, name) is not None:
                setattr(self, name, positive(getattr(self, name), self._label(name)))
        self.embed_scale = positive(self.embed_scale, "embed_scale")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self._label('n_heads')}={self.n_heads} is not a multiple of "
                f"{self._label('n_kv_heads')}={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"{self._label('head_dim')}={self.head_dim} must be even (RoPE rotates pairs)")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        s = self.rope_scaling
        if s is None:
            return
        if not isinstance(s, dict):
            raise TypeError(f"rope_scaling must be a mapping, got {type(s).__name__}")
        kind = rope_scaling_kind(s)
        if kind not in ROPE_SCALING:
            raise ValueError(
                f"unsupported rope scaling {kind!r}; kvlens implements: {', '.join(ROPE_SCALING)}"
            )
        for key in ROPE_SCALING[kind]:
            positive(s.get(key), f"rope_scaling.{key}")
        if kind == "llama3" and not s["high_freq_factor"] > s["low_freq_factor"]:
            raise ValueError("rope_scaling.high_freq_factor must be > low_freq_factor")

    def is_windowed(self, layer: int) -> bool:
        """Whether ``layer`` attends only its last ``sliding_window`` positions."""
        if self.sliding_window is None:
            return False
        if self.window_layers is not None:
            return layer in self.window_layers
        return self.sliding_pattern is None or (layer + 1) % self.sliding_pattern != 0

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full causal attention)."""
        return tuple(self.sliding_window if self.is_windowed(i) else None for i in range(self.n_layers))

    @property
    def attn_scale(self) -> float:
        """The softmax scale of attention scores (the kernels use 1/sqrt(head_dim); q absorbs the rest)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads


HF_KEYS = {
    "n_layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
    "rope_theta": "rope_theta",
    "rms_eps": "rms_norm_eps",
    "max_ctx": "max_position_embeddings",
    "sliding_window": "sliding_window",
}
# What transformers' config class of each architecture reads for a key config.json lacks, where the
# architectures differ (all four: rms_norm_eps 1e-6, rope_theta 10000, untied embeddings): a config
# that leaves a key out means here what it means to transformers. tests/test_config_hf_defaults.py
# checks every entry against transformers itself.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_ctx": 2048},
    "mistral": {"max_ctx": 131072, "n_kv_heads": 8, "sliding_window": 4096},
    "qwen2": {"max_ctx": 32768, "n_kv_heads": 32, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {
        "max_ctx": 32768,
        "n_kv_heads": 32,
        "head_dim": 128,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
}
HF_RMS_EPS = 1e-6
HF_ATTENTION_BIAS = ("llama", "qwen3")  # read attention_bias (true: refused); Mistral and Qwen2 fix theirs
# hidden_act names transformers maps to the activations kvlens implements (the same function each)
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
LAYER_TYPES = ("full_attention", "sliding_attention")  # Qwen2/3's layer_types entries


def _of_type(kind: type, what: str) -> Callable[[Any, str], Any]:
    """A :func:`read_key` check that the value is a ``kind`` (``what``: the words for one)."""
    return lambda value, name: check_instance(value, kind, name, what)


_flag = _of_type(bool, "true or false")
_mapping = _of_type(dict, "a JSON object")


def config_from_hf(cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from an HF ``config.json`` dict; a bad value names its key."""
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where} must hold a JSON object, got {type(cfg).__name__}")
    arch = cfg.get("model_type", "")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{where}: model_type must be a string, got {type(arch).__name__}")
    if arch.startswith("gemma"):
        raise ModelLoadError(
            f"{where}: model_type {arch!r} loads from its GGUF file only in kvlens (give the .gguf)"
        )
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported model_type {arch!r} in {where}; kvlens implements: {', '.join(ARCHITECTURES)}"
        )
    quantized = cfg.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else None
        raise ModelLoadError(
            f"{where}: a quantized checkpoint (quantization_config, quant_method {method!r}); kvlens reads "
            "F32/F16/BF16 safetensors or a GGUF file, and quantizes its weights itself (--weights int8, int4)"
        )

    def get(field_name: str, check: Callable[[Any, str], Any] = count, default: Any = REQUIRED) -> Any:
        return read_key(cfg, HF_KEYS[field_name], where, check, default)

    shape = read_shape(get, HF_KEYS, where, {"rms_eps": HF_RMS_EPS, **HF_DEFAULTS[arch]})
    scaling = read_key(cfg, "rope_scaling", where, _mapping, None) or read_key(
        cfg, "rope_parameters", where, _mapping, None
    )
    theta = get("rope_theta", positive, None) or read_key(
        scaling or {}, "rope_theta", where, positive, 10000.0
    )
    if scaling and rope_scaling_kind(scaling) == "default":
        scaling = None
    fields = dict(
        arch=arch,
        **shape,
        vocab=get("vocab"),
        rope_theta=theta,
        tied_embeddings=read_key(cfg, "tie_word_embeddings", where, _flag, False),
        qkv_bias=_hf_biases(cfg, arch, where),
        qk_norm=ARCHITECTURES[arch]["qk_norm"],
        rope_scaling=dict(scaling) if scaling else None,
        **_hf_window(cfg, arch, where, shape["n_layers"]),
        hidden_act=_hf_activation(cfg, where),
        name=str(cfg.get("_name_or_path", "")),
    )
    return build_config(fields, HF_KEYS, where)


def _hf_biases(cfg: dict[str, Any], arch: str, where: str) -> bool:
    """Whether q/k/v carry biases, as transformers builds the architecture; the biases transformers
    adds that kvlens does not implement are refused by their key, before any tensor is read."""
    if arch in HF_ATTENTION_BIAS and read_key(cfg, "attention_bias", where, _flag, False):
        raise ModelLoadError(
            f"{where}: attention_bias is true, which gives {arch}'s o_proj a bias as well as q/k/v; "
            "kvlens does not implement an o_proj bias"
        )
    if arch == "llama" and read_key(cfg, "mlp_bias", where, _flag, False):
        raise ModelLoadError(f"{where}: mlp_bias is true; kvlens does not implement MLP biases")
    return ARCHITECTURES[arch]["qkv_bias"]


def _hf_activation(cfg: dict[str, Any], where: str) -> str:
    """The MLP gate's activation (``hidden_act``; absent: silu, as in all four config classes)."""
    name = cfg.get("hidden_act", "silu")
    if not isinstance(name, str) or name not in HF_ACTIVATIONS:
        raise ModelLoadError(
            f"{where}: hidden_act={name!r} is not supported; kvlens implements {', '.join(HF_ACTIVATIONS)}"
        )
    return HF_ACTIVATIONS[name]


def _hf_window(cfg: dict[str, Any], arch: str, where: str, n_layers: int) -> dict[str, Any]:
    """The attention window as transformers reads it: Mistral windows every layer unless
    ``sliding_window`` is null (it ignores ``layer_types``); Qwen2/3: see :func:`_qwen_window`; Llama
    never (it ignores all these keys)."""
    defaults = HF_DEFAULTS[arch]
    if "sliding_window" not in defaults:
        return {"sliding_window": None}
    if "max_window_layers" in defaults:
        return _qwen_window(cfg, where, n_layers, defaults)
    return {"sliding_window": _stated_window(cfg, where, defaults["sliding_window"])}


def _stated_window(cfg: dict[str, Any], where: str, default: int) -> int | None:
    """``sliding_window`` as transformers reads it: null, no window; absent, the class's default."""
    if "sliding_window" in cfg and cfg["sliding_window"] is None:
        return None
    return read_key(cfg, "sliding_window", where, count, default)


def _qwen_window(cfg: dict[str, Any], where: str, n_layers: int, defaults: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/3: a window only with ``use_sliding_window`` and a ``sliding_window`` that is not null, on
    the layers ``layer_types`` marks ``sliding_attention``; without ``layer_types``, on the layers from
    ``max_window_layers`` on. A sliding layer without a window is refused (transformers fails on it)."""
    window = None
    if read_key(cfg, "use_sliding_window", where, _flag, False):
        window = _stated_window(cfg, where, defaults["sliding_window"])
    types = cfg.get("layer_types")
    if types is None:
        if window is None:
            return {"sliding_window": None}
        first = read_key(cfg, "max_window_layers", where, non_negative, defaults["max_window_layers"])
        return {"sliding_window": window, "window_layers": tuple(range(first, n_layers))}
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(
            f"{where}: layer_types must list {' or '.join(LAYER_TYPES)} for each of the {n_layers} layers, "
            f"got {types!r}"
        )
    windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if windowed and window is None:
        raise ModelLoadError(
            f"{where}: layer_types marks layers {list(windowed)} sliding_attention, but there is no window "
            "(use_sliding_window is false or sliding_window is null)"
        )
    return {"sliding_window": window if windowed else None, "window_layers": windowed}


def read_shape(
    get: Callable[..., Any], keys: dict[str, str], where: str, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The fields every loader reads alike: layer count and sizes (the head size as given, else the
    source's default, else hidden / n_heads when that divides), the norm epsilon and the context
    length. ``defaults``: what the source's reference reads for an absent key (``REQUIRED``: none)."""
    hidden, n_heads = get("hidden"), get("n_heads")
    head_dim = get("head_dim", count, defaults.get("head_dim"))
    if head_dim is None:
        if hidden % n_heads:
            raise ModelLoadError(
                f"{where}: {keys['hidden']}={hidden} is not a multiple of {keys['n_heads']}={n_heads}"
            )
        head_dim = hidden // n_heads
    return dict(
        n_layers=get("n_layers"),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=get("n_kv_heads", count, defaults.get("n_kv_heads", n_heads)),
        head_dim=head_dim,
        ffn=get("ffn"),
        rms_eps=get("rms_eps", positive, defaults["rms_eps"]),
        max_ctx=get("max_ctx", count, defaults["max_ctx"]),
    )


def build_config(fields: dict[str, Any], keys: dict[str, str], where: str) -> ModelConfig:
    """:class:`ModelConfig` from loader-read fields; an inconsistency names the source and its keys."""
    try:
        return ModelConfig(**fields, keys=dict(keys))
    except ModelLoadError as e:
        raise ModelLoadError(f"{where}: {e}") from None


def check_readable(path: Path) -> Path:
    """``path`` opened for reading once, so a permission problem is called what it is."""
    check_not_special(path, ModelLoadError)
    try:
        with open(path, "rb"):
            pass
    except IsADirectoryError:
        raise ModelLoadError(f"{path} is a directory, expected a file") from None
    except OSError as e:
        raise ModelLoadError(f"cannot open {path}: {e.strerror or e}") from None
    return path
