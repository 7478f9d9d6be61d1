import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file, load_file
sys.path.insert(0, ".")
from tiny_models import write_hf
import transformers as tf
import kvlens

out = Path("/tmp/probe44-tied"); import shutil; shutil.rmtree(out, ignore_errors=True)
write_hf("qwen2", out)  # tied
cfg = json.loads((out / "config.json").read_text()); print("tie:", cfg.get("tie_word_embeddings"))
idx = json.loads((out / "model.safetensors.index.json").read_text())
print("lm_head in index:", "lm_head.weight" in idx["weight_map"])
emb_file = idx["weight_map"]["model.embed_tokens.weight"]
emb = load_file(out / emb_file)["model.embed_tokens.weight"]
torch.manual_seed(5)
head = torch.randn_like(emb)
save_file({"lm_head.weight": head}, out / "extra-head.safetensors", metadata={"format": "pt"})
idx["weight_map"]["lm_head.weight"] = "extra-head.safetensors"
(out / "model.safetensors.index.json").write_text(json.dumps(idx))
m = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
lm = m.lm_head.weight
print("hf lm_head == embed:", torch.equal(lm, m.model.embed_tokens.weight), " == stored head:", torch.equal(lm.float(), head))
ids = [1, 5, 9, 3]
ref = m(torch.tensor([ids])).logits[0]
try:
    llm = kvlens.load(out, kv="f32")
    got = llm.logits(ids)
    print("kvlens tied:", llm.config.tied_embeddings, "max diff vs hf:", (got.double() - ref).abs().max().item())
except Exception as e:
    print("kvlens:", type(e).__name__, e)
