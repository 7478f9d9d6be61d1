import json, time, httpx, sys, socket
PORT = None
def url(p=""): return f"http://127.0.0.1:{PORT}{p}"
def setup(name):
    global PORT
    PORT = int(open(f"/tmp/hostile36-http/{name}.port").read())
    return PORT
CASES = "/tmp/hostile36-http/cases.txt"
SUSPECT = []
def rec(name, sent, status, body, note=""):
    b = body if isinstance(body, str) else body.decode("utf-8", "replace")
    line = f"[{name}] sent={sent[:200]} -> {status} {b[:150]!r} {note}".replace("\n", "\\n")
    with open(CASES, "a") as f: f.write(line + "\n")
    print(line[:400])
def shape_ok(status, text):
    if status < 400: return True
    try:
        e = json.loads(text)["error"]
        return set(e) == {"message", "type", "param", "code"}
    except Exception:
        return False
def call(name, path="/v1/completions", js=None, method="POST", content=None, headers=None, timeout=120, note=""):
    t = time.time()
    try:
        r = httpx.request(method, url(path), json=js, content=content, headers=headers, timeout=timeout)
        st, txt = r.status_code, r.text
    except Exception as e:
        st, txt = "EXC", repr(e)
    dt = time.time() - t
    flag = ""
    if st == "EXC" or (isinstance(st, int) and st >= 500) or not shape_ok(st, txt) if isinstance(st,int) else True:
        flag = " <<SUSPECT"
    sent = json.dumps(js)[:200] if js is not None else repr(content)[:200] if content is not None else ""
    rec(name, f"{method} {path} {sent} hdr={headers}", st, txt, note + f" ({dt:.1f}s)" + flag)
    return st, txt
def health():
    try: return httpx.get(url("/health"), timeout=10).status_code
    except Exception as e: return repr(e)
def metric(name):
    t = httpx.get(url("/metrics"), timeout=10).text
    for l in t.splitlines():
        if l.startswith(name + " ") or l.startswith(name + "{"):
            return float(l.split()[-1])
def metrics():
    return httpx.get(url("/metrics"), timeout=10).text
