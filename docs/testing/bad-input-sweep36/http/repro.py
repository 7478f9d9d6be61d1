import httpx, json, sys, threading, time
U = f"http://127.0.0.1:{open('/tmp/hostile36-http/C.port').read().strip()}"
J = {"content-type": "application/json"}
# 1 tiny temperature kills concurrent request
out = {}
def victim():
    r = httpx.post(f"{U}/v1/completions", json={"model": "smollm2", "prompt": "Write a story.", "max_tokens": 200, "temperature": 0, "ignore_eos": True}, timeout=120)
    out["victim"] = (r.status_code, r.text[:160])
t = threading.Thread(target=victim); t.start(); time.sleep(1)
r = httpx.post(f"{U}/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 5, "temperature": 1e-40}, timeout=60)
t.join(); print("R1 attacker", r.status_code, r.text[:160]); print("R1 victim", out["victim"])
# 2 model surrogate
r = httpx.post(f"{U}/v1/completions", content=b'{"model":"\\ud800","prompt":"Hi"}', headers=J); print("R2", r.status_code, r.text)
# 3 empty body
r = httpx.post(f"{U}/v1/completions", content=b"", headers=J); print("R3", r.status_code, r.text)
# 4 bytes field
r = httpx.post(f"{U}/v1/chat/completions", json={"model": "smollm2", "messages": [{"role": "user", "content": "Reply with only these emoji: 😀🎉🚀"}], "max_tokens": 8, "temperature": 0, "logprobs": True})
c = r.json()["choices"][0]; print("R4", repr(c["message"]["content"]), [e["bytes"] for e in c["logprobs"]["content"]][:3])
# 5 top_p tiny
r = httpx.post(f"{U}/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3, "temperature": 1, "top_p": 1e-300}); print("R5", r.status_code, r.text[:160])
# 6 bool token ids
r = httpx.post(f"{U}/v1/completions", json={"model": "smollm2", "prompt": [True, False], "max_tokens": 2}); print("R6", r.status_code, r.json().get("usage"))
# 7 nested list message
r = httpx.post(f"{U}/v1/completions", json={"model": "smollm2", "prompt": [[1, 2], [3]]}); print("R7", r.status_code, r.text)
r = httpx.post(f"{U}/v1/chat/completions", json={"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}); print("R7b", r.status_code, r.text)
# 8 max_tokens blamed on prompt
r = httpx.post(f"{U}/v1/chat/completions", json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}); print("R8", r.status_code, r.text)
# 9 HEAD /health
r = httpx.head(f"{U}/health"); print("R9", r.status_code)
# 10 lowercase bearer -> needs api-key server (shown in cases)
