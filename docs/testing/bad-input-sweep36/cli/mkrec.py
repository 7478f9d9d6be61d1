import json, copy, kvlens
from kvlens.engine.verify import make_record, ids_sha256
from kvlens.engine.sequence import Request
from kvlens.engine.scheduler import run_alone
llm = kvlens.load("smollm2", kv="q8")
ids = llm.encode_prompt("The capital of France is")
req = Request("r", ids, 3)
out = [e.token_id for e in run_alone(llm, req) if e.token_id is not None]
rec = make_record(llm, req, out)
D = "/tmp/hostile36-cli/fx/rec/"
json.dump(rec, open(D+"good.json","w"))
def mut(name, f, fix=True):
    r = copy.deepcopy(rec); f(r)
    if fix:
        try: r["prompt_sha256"] = ids_sha256(r["prompt_ids"])
        except Exception: pass
        try: r["output_sha256"] = ids_sha256(r["output_ids"])
        except Exception: pass
    json.dump(r, open(D+name+".json","w"))
mut("model_str", lambda r: r.__setitem__("model", "smollm2"))
mut("model_empty", lambda r: r.__setitem__("model", {}))
mut("sampling_list", lambda r: r.__setitem__("sampling", [0, 0, 1, None]))
mut("sampling_empty", lambda r: r.__setitem__("sampling", {}))
mut("sampling_temp_str", lambda r: r["sampling"].__setitem__("temperature", "hot"))
mut("max_tokens_null", lambda r: r.__setitem__("max_tokens", None))
mut("max_tokens_float", lambda r: r.__setitem__("max_tokens", 2.9))
mut("max_tokens_bool", lambda r: r.__setitem__("max_tokens", True))
mut("max_tokens_neg", lambda r: r.__setitem__("max_tokens", -3))
mut("prefill_chunk_float", lambda r: r.__setitem__("prefill_chunk", 32.7))
mut("prefill_chunk_str", lambda r: r.__setitem__("prefill_chunk", "abc"))
mut("prompt_ids_big", lambda r: r.__setitem__("prompt_ids", [2**40]))
mut("prompt_ids_oov", lambda r: r.__setitem__("prompt_ids", [99999]))
mut("prompt_ids_neg", lambda r: r.__setitem__("prompt_ids", [-1, 5]))
mut("prompt_ids_empty", lambda r: r.__setitem__("prompt_ids", []))
mut("prompt_ids_floats", lambda r: r.__setitem__("prompt_ids", [1.7, 2.2]))
mut("prompt_ids_dict", lambda r: r.__setitem__("prompt_ids", {"a": 1}))
mut("prompt_ids_str", lambda r: r.__setitem__("prompt_ids", "hello"))
mut("prompt_ids_bools", lambda r: r.__setitem__("prompt_ids", [True, False]))
mut("output_ids_nested", lambda r: r.__setitem__("output_ids", [[1, 2]]))
mut("stop_ids_str", lambda r: r.__setitem__("stop_ids", "abc"))
mut("stop_ids_int", lambda r: r.__setitem__("stop_ids", 5))
mut("kv_int", lambda r: r.__setitem__("kv", 8))
mut("device_bogus", lambda r: r.__setitem__("device", "tpu"))
mut("attn_null", lambda r: r.__setitem__("attn_backend", None))
mut("mirror_bogus", lambda r: r.__setitem__("mirror_prefill", 7))
mut("weights_list", lambda r: r.__setitem__("weights", ["int8"]))
mut("source_missing_file", lambda r: r["model"].__setitem__("source", "/nonexistent/model.gguf"))
mut("version_99", lambda r: r.__setitem__("record_version", 99))
mut("kvlens_wrapper_list", lambda r: None)
json.dump({"kvlens": [rec]}, open(D+"wrapper_list.json","w"))
json.dump({"kvlens": "x", **rec}, open(D+"wrapper_str.json","w"))
print(json.dumps(rec)[:400])
