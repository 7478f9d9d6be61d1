"""config.json keys that change the model's arithmetic, read as transformers reads them: ``hidden_act``
(kvlens ran SiLU whatever it said), Qwen2/3's ``layer_types`` (it decides which layers are windowed,
over ``max_window_layers``; kvlens ignored it), and the biases kvlens does not implement (Llama's and
Qwen3's ``attention_bias`` puts one on o_proj too, Llama's ``mlp_bias`` on the MLP): refused by their
key, where a tensor named "unexpected (llama does not use it)" was all the user got. Found by the
forty-fourth session's probe of every such key against transformers' forward pass."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from bounds import f32_forward_tol
from test_config_hf_defaults import REQUIRED, transformers_windows
from test_models import IDS, float64_logits
from tiny_models import write_hf

import kvlens
from kvlens.models.config import HF_ACTIVATIONS, ModelLoadError, config_from_hf
from kvlens.models.transformer import ACTIVATION

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
WHERE = "m/config.json"


@pytest.mark.parametrize("name", sorted(HF_ACTIVATIONS))
def test_each_activation_name_is_transformers_function(name):
    """The kvlens activation a name maps to is transformers' ``ACT2FN[name]`` in float64, to rounding."""
    from transformers.activations import ACT2FN

    x = torch.linspace(-8.0, 8.0, 4001, dtype=torch.float64)
    ours = ACTIVATION[config_from_hf({"model_type": "llama", **REQUIRED, "hidden_act": name}).hidden_act]
    assert (ours(x) - ACT2FN[name](x)).abs().max().item() <= 8 * 2.0**-52 * 8.0


@pytest.mark.parametrize(
    "arch, name",
    [
        ("llama", "gelu_new"),
        ("mistral", "gelu_pytorch_tanh"),
        ("qwen2", "gelu_python_tanh"),
        ("qwen3", "swish"),
    ],
)
def test_a_tiny_model_runs_its_activation(tmp_path, arch, name):
    hf = write_hf(arch, tmp_path, hidden_act=name)
    ref = float64_logits(hf, IDS)
    llm = kvlens.load(tmp_path, kv="f32", attn_backend="torch")
    tol = f32_forward_tol(llm.config, ref)
    assert (llm.logits(IDS).double() - ref).abs().max().item() <= tol
    if HF_ACTIVATIONS[name] == "silu":
        return
    silu = write_hf(arch, tmp_path / "silu", hidden_act="silu")  # what kvlens ran before: far off
    assert (float64_logits(silu, IDS) - ref).abs().max().item() > 100 * tol


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("value", ["gelu", "relu", "gelu_fast", "SiLU", None, 5, ["silu"]])
def test_an_activation_kvlens_lacks_is_refused_by_key(arch, value):
    with pytest.raises(ModelLoadError) as refused:
        config_from_hf({"model_type": arch, **REQUIRED, "hidden_act": value}, WHERE)
    assert str(refused.value).startswith(
        f"{WHERE}: hidden_act={value!r} is not supported; kvlens implements silu"
    )


FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = [
    {"use_sliding_window": True, "sliding_window": 8, "layer_types": [FULL, SLIDING, FULL, SLIDING]},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0, "layer_types": [FULL] * 3 + [SLIDING]},
    {"use_sliding_window": True, "max_window_layers": 3, "layer_types": [SLIDING] * 4},
    {"use_sliding_window": True, "sliding_window": 8, "layer_types": [FULL] * 4},
    {"use_sliding_window": False, "layer_types": [FULL] * 4},
    {"use_sliding_window": True, "sliding_window": None, "layer_types": [FULL] * 4},
    {"sliding_window": 8, "layer_types": [SLIDING, FULL, FULL, FULL]},  # Mistral ignores it; Qwen: no window
]  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("optional", LAYER_TYPES, ids=str)
def test_layer_types_window_the_layers_transformers_windows(arch, optional):
    """Qwen2/3's attention layers read ``layer_types``; Mistral's and Llama's classes ignore it."""
    body = REQUIRED | optional
    hf = transformers.AutoConfig.for_model(arch, **copy.deepcopy(body))
    if not arch.startswith("qwen"):
        hf.layer_types = None  # kept by the config class, read by no layer of the model
    elif hf.sliding_window is None and SLIDING in hf.layer_types:  # transformers' forward fails on it
        with pytest.raises(
            ModelLoadError, match=r"marks layers \[0\] sliding_attention, but there is no window"
        ):
            config_from_hf({"model_type": arch, **body}, WHERE)
        return
    assert config_from_hf({"model_type": arch, **body}).layer_windows == transformers_windows(hf)


def test_layer_types_over_max_window_layers_in_the_forward_pass(tmp_path):
    """Layer 1 alone windowed by layer_types, though max_window_layers 0 would window both: kvlens
    windowed both, 5e-2 off transformers."""
    kw = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    hf = write_hf("qwen2", tmp_path / "types", layer_types=[FULL, SLIDING], **kw)
    ref = float64_logits(hf, IDS)
    llm = kvlens.load(tmp_path / "types", kv="f32", attn_backend="torch")
    assert llm.config.layer_windows == (None, 4)
    tol = f32_forward_tol(llm.config, ref)
    assert (llm.logits(IDS, prefill_chunk=5).double() - ref).abs().max().item() <= tol
    both = write_hf("qwen2", tmp_path / "both", **kw)
    assert (float64_logits(both, IDS) - ref).abs().max().item() > 100 * tol


@pytest.mark.parametrize(
    "layer_types, needle",
    [
        ([FULL] * 3, r"layer_types must list full_attention or sliding_attention for each of the 4 layers"),
        ([FULL, FULL, FULL, "chunked_attention"], "for each of the 4 layers, got"),
        ("full_attention", "for each of the 4 layers, got 'full_attention'"),
        ([FULL, [SLIDING], FULL, FULL], "for each of the 4 layers"),
    ],
)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bad_layer_types_are_refused_by_key(arch, layer_types, needle):
    body = {"model_type": arch, **REQUIRED, "use_sliding_window": True, "layer_types": layer_types}
    with pytest.raises(ModelLoadError, match=needle) as refused:
        config_from_hf(body, WHERE)
    assert str(refused.value).startswith(f"{WHERE}: layer_types must list")


@pytest.mark.parametrize(
    "arch, key, needle",
    [
        (
            "llama",
            "attention_bias",
            "attention_bias is true, which gives llama's o_proj a bias as well as q/k/v; "
            "kvlens does not implement an o_proj bias",
        ),
        (
            "qwen3",
            "attention_bias",
            "attention_bias is true, which gives qwen3's o_proj a bias as well as q/k/v; "
            "kvlens does not implement an o_proj bias",
        ),
        ("llama", "mlp_bias", "mlp_bias is true; kvlens does not implement MLP biases"),
    ],  # fmt: skip
)
def test_a_bias_kvlens_lacks_is_refused_by_key_before_any_tensor(tmp_path, arch, key, needle):
    """The files of such a model load in transformers with the bias; kvlens names the key, not a tensor."""
    hf = write_hf(arch, tmp_path, **{key: True})
    named = [n for n, _ in hf.named_parameters() if n.endswith("bias")]
    assert any("o_proj" in n or "mlp" in n for n in named)
    with pytest.raises(ModelLoadError) as refused:
        kvlens.load(tmp_path, kv="f32")
    assert str(refused.value) == f"{tmp_path / 'config.json'}: {needle}"


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_attention_bias_and_mlp_bias_mean_nothing_where_transformers_ignores_them(arch):
    """Mistral's and Qwen2's classes fix their biases (Qwen2: q/k/v only), as does every class but
    Llama's for mlp_bias."""
    body = {"model_type": arch, **REQUIRED, "attention_bias": True, "mlp_bias": True}
    assert config_from_hf(body).qkv_bias == (arch == "qwen2")


@pytest.mark.parametrize(
    "quantization, method",
    [
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "fp8"}, "'fp8'"),
        ({}, "None"),
        ("x", "None"),
    ],
)
def test_a_quantized_checkpoint_is_refused_by_its_config(quantization, method):
    """GPTQ/AWQ/FP8 checkpoints hold integer or fp8 tensors and scales that transformers' quantizers
    read; kvlens named only the first tensor's dtype. Now the config says what the file is."""
    body = {"model_type": "llama", **REQUIRED, "quantization_config": quantization}
    with pytest.raises(ModelLoadError) as refused:
        config_from_hf(body, WHERE)
    assert str(refused.value) == (
        f"{WHERE}: a quantized checkpoint (quantization_config, quant_method {method}); kvlens reads "
        "F32/F16/BF16 safetensors or a GGUF file, and quantizes its weights itself (--weights int8, int4)"
    )
