import math, torch, kvlens, traceback
llm = kvlens.load("smollm2", kv="q8")
ids = llm.tokenizer.encode("The capital of France is")
cases = {
 "generate_ids n=-1": lambda: list(llm.generate_ids(ids, -1)),
 "generate_ids n=True": lambda: list(llm.generate_ids(ids, True)),
 "logits []": lambda: llm.logits([]),
 "logits prefill_chunk=0": lambda: llm.logits(ids, prefill_chunk=0),
 "logits prefill_chunk=-2": lambda: llm.logits(ids, prefill_chunk=-2),
 "new_cache 0": lambda: llm.new_cache(0),
 "capture_qkv layers=[99]": lambda: llm.capture_qkv(ids, layers=[99]),
 "capture_qkv layers=[-1]": lambda: llm.capture_qkv(ids, layers=[-1]),
 "variant kv=q9": lambda: llm.variant(kv="q9"),
 "variant bogus=1": lambda: llm.variant(bogus=1),
 "decode [99999]": lambda: llm.tokenizer.decode([99999]),
 "decode [-1]": lambda: llm.tokenizer.decode([-1]),
 "encode_prompt system=5": lambda: llm.encode_prompt("hi", chat=True, system=5),
}
for name, fn in cases.items():
    try:
        r = fn()
        print(f"{name:32s} -> OK {str(r)[:60]!r}")
    except (ValueError, TypeError) as e:
        print(f"{name:32s} -> {type(e).__name__}: {str(e)[:110]}")
    except Exception as e:
        print(f"{name:32s} -> !!! {type(e).__name__}: {str(e)[:110]}")
