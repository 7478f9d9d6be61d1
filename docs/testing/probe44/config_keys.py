import shutil, torch, warnings
from pathlib import Path
from tiny_models import write_hf
from test_models import IDS, float64_logits
import kvlens
warnings.filterwarnings("ignore")
cases = [
    ("llama", dict(hidden_act="gelu_new")),
    ("llama", dict(hidden_act="swish")),
    ("qwen3", dict(hidden_act="gelu_pytorch_tanh")),
    ("llama", dict(partial_rotary_factor=0.5)),
    ("qwen2", dict(partial_rotary_factor=0.5)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0, layer_types=["full_attention", "sliding_attention"])),
    ("qwen3", dict(use_sliding_window=False, sliding_window=4, layer_types=["sliding_attention", "sliding_attention"])),
    ("mistral", dict(sliding_window=4, layer_types=["full_attention", "sliding_attention"])),
    ("llama", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)),
    ("qwen3", dict(attention_bias=True)),
    ("qwen2", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})),
]
for arch, extra in cases:
    out = Path("/tmp/probe44-cfg"); shutil.rmtree(out, ignore_errors=True)
    try:
        hf = write_hf(arch, out, **extra)
    except Exception as e:
        print(arch, extra, "HF refuses:", type(e).__name__, str(e)[:100]); continue
    try:
        ref = float64_logits(hf, IDS)
    except Exception as e:
        print(arch, extra, "HF forward fails:", type(e).__name__, str(e)[:80]); continue
    try:
        llm = kvlens.load(out, kv="f32", attn_backend="torch")
        print(arch, extra, "kvlens runs, diff:", f"{(llm.logits(IDS).double() - ref).abs().max().item():.2e}", "windows", llm.config.layer_windows)
    except Exception as e:
        print(arch, extra, "kvlens:", type(e).__name__, str(e)[:160])
