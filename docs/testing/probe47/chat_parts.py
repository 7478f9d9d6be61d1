"""What the chat template receives for a message sent as content parts, and for one with a name.
vLLM ("\\n".join of the text parts, for a template that reads content as text) and llama.cpp's server
(concat_typed_text) join parts with newlines; vLLM and transformers pass `name` on.
Run: .venv/bin/python docs/testing/probe47/chat_parts.py
"""

from kvlens.serve.protocol import ChatRequest

body = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Answer briefly.", "name": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "world"}]},
    ],
}
for m in ChatRequest.model_validate(body).messages:
    print(m.for_template())
