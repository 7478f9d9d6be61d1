"""A config.json means to kvlens what it means to transformers, keys left out included: each
architecture's config class fills its own defaults (Mistral 131072 positions, 8 KV heads and a
4096 window; Qwen3 a head size of 128; all an RMS epsilon of 1e-6), Mistral's window is off only when
``sliding_window`` is null, and Qwen2/3 window only the layers from ``max_window_layers`` on, and only
with ``use_sliding_window``; only Llama's and Qwen3's classes read ``attention_bias``. Expected values
are read from transformers' own config classes and models; the window's effect on the logits is checked
against transformers' forward pass. Each refusal names the file it read. The forty-third session's
mutation run of ``models/config.py`` found these unasserted (docs/testing.md)."""

from __future__ import annotations

import copy

import pytest
import transformers
from bounds import f32_forward_tol
from test_gemma3 import step_logits
from test_models import IDS, float64_logits
from tiny_models import write_hf

import kvlens
from kvlens.models.config import ModelLoadError, config_from_hf
from kvlens.models.gguf_loader import config_from_gguf

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# the keys every config must give (kvlens refuses a config without them); 32 heads so that
# Mistral's and Qwen's default KV head counts (8, 32) divide them
REQUIRED = dict(
    hidden_size=256, num_attention_heads=32, num_hidden_layers=4, intermediate_size=64, vocab_size=100
)
OPTIONAL = [
    {},
    {"sliding_window": None},
    {"use_sliding_window": True},
    {"use_sliding_window": True, "sliding_window": None},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
    {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0},
    {"sliding_window": 8, "max_window_layers": 1},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 9},
    {"attention_bias": True},
    {"attention_bias": False},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},  # the key's older name
    {"rope_scaling": {"type": "default"}},
    {"rope_scaling": {"rope_type": "default"}, "rope_theta": 5e5},
    {"rope_scaling": {"rope_type": "linear", "factor": 3.0}, "rope_theta": 2e4},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
    {"_name_or_path": "org/model"},
    dict(
        num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512,
        rope_theta=5e5, tie_word_embeddings=True,
    ),
]  # fmt: skip


def transformers_windows(hf) -> tuple[int | None, ...]:
    """Each layer's window as transformers' model uses it: Qwen2/3 by ``layer_types``, Mistral its
    ``sliding_window`` on every layer, Llama none."""
    n = hf.num_hidden_layers
    if hf.model_type == "llama":
        return (None,) * n
    if getattr(hf, "layer_types", None) is None:
        return (hf.sliding_window,) * n
    return tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("optional", OPTIONAL, ids=lambda d: ",".join(d) or "none")
def test_a_config_reads_as_transformers_reads_it(arch, optional):
    body = REQUIRED | optional
    hf = transformers.AutoConfig.for_model(arch, **copy.deepcopy(body))  # it adds keys to the dicts given
    attention = transformers.AutoModelForCausalLM.from_config(hf).model.layers[0].self_attn
    if attention.o_proj.bias is not None:  # Llama's and Qwen3's attention_bias: not implemented, refused
        with pytest.raises(ModelLoadError, match="attention_bias is true, which gives .* o_proj a bias"):
            config_from_hf({"model_type": arch, **body})
        assert arch in ("llama", "qwen3") and optional == {"attention_bias": True}
        return
    ours = config_from_hf({"model_type": arch, **body})
    got = (ours.rms_eps, ours.max_ctx, ours.rope_theta, ours.n_kv_heads, ours.head_dim, ours.tied_embeddings)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    want = (
        hf.rms_norm_eps, hf.max_position_embeddings, hf.rope_parameters["rope_theta"],
        hf.num_key_value_heads, head_dim, hf.tie_word_embeddings,
    )  # fmt: skip
    assert got == want
    assert ours.layer_windows == transformers_windows(hf)
    assert ours.name == hf.name_or_path
    scaling = ours.rope_scaling or {"rope_type": "default"}
    assert scaling.get("rope_type", scaling.get("type")) == hf.rope_parameters["rope_type"]
    assert scaling.get("factor") == hf.rope_parameters.get("factor")
    assert ours.qkv_bias == (attention.q_proj.bias is not None)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("use_sliding_window", 1, "use_sliding_window must be true or false"),
        ("max_window_layers", -1, "max_window_layers must be ≥ 0"),
        ("max_window_layers", 1.5, "max_window_layers must be an integer"),
        ("model_type", 5, "model_type must be a string, got int"),
        ("model_type", ["qwen2"], "model_type must be a string, got list"),
    ],
)
def test_a_bad_window_key_or_model_type_is_refused_by_name(key, value, needle):
    body = {"model_type": "qwen2", **REQUIRED, "use_sliding_window": True, key: value}
    with pytest.raises(ModelLoadError, match=needle):
        config_from_hf(body)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_qwen2_windows_only_the_layers_from_max_window_layers_on(tmp_path, backend):
    """Two layers, the second windowed (4 positions over 12 tokens): chunked prefill and decode equal
    transformers' float64 forward; windowing both layers, or neither, is far off it."""
    hf = write_hf("qwen2", tmp_path / "hf", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ref = float64_logits(hf, IDS)
    llm = kvlens.load(tmp_path / "hf", kv="f32", attn_backend=backend)
    assert llm.config.layer_windows == (None, 4)
    tol = f32_forward_tol(llm.config, ref)
    for out in (llm.logits(IDS, prefill_chunk=5), step_logits(llm, IDS)):
        assert (out.double() - ref).abs().max().item() <= tol
    for other in (0, 2):  # both layers windowed; neither
        variant = write_hf("qwen2", tmp_path / f"hf{other}", use_sliding_window=True, sliding_window=4,
                           max_window_layers=other)  # fmt: skip
        assert (float64_logits(variant, IDS) - ref).abs().max().item() > 100 * tol


@pytest.mark.parametrize("arch", [["llama"], 5, None])
def test_a_gguf_architecture_that_is_not_a_name_is_refused(arch):
    """An array or number under general.architecture is unsupported, said as such (it was a TypeError
    from the dict lookup: a list is unhashable)."""
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture"):
        config_from_gguf({"general.architecture": arch})


WHERE = "some/dir/config.json"


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"num_hidden_layers": None}, "lacks num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be ≥ 1"),
        ({"hidden_size": 250}, "hidden_size=250 is not a multiple of num_attention_heads=32"),
        ({"num_key_value_heads": 5}, "is not a multiple of"),
        ({"rope_scaling": "linear"}, "rope_scaling must be a JSON object"),
        ({"rope_parameters": [1]}, "rope_parameters must be a JSON object"),
        ({"rope_parameters": {"rope_theta": -1.0}}, "rope_theta must be > 0"),
        ({"use_sliding_window": "yes"}, "use_sliding_window must be true or false"),
        ({"use_sliding_window": True, "max_window_layers": -1}, "max_window_layers must be ≥ 0"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"model_type": "qwen3", "attention_bias": "yes"}, "attention_bias must be true or false"),
    ],
)
def test_a_refusal_names_the_file_it_read(change, needle):
    """Every refusal starts with the file it came from, so a user with several model folders knows
    which config.json to fix."""
    body = {"model_type": "qwen2", **REQUIRED} | change
    with pytest.raises(ModelLoadError) as e:
        config_from_hf({k: v for k, v in body.items() if v is not None}, where=WHERE)
    assert str(e.value).startswith(WHERE) and needle in str(e.value)
