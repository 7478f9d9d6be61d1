"""Before/after probe of the forty-fifth session: chat templates rendered by kvlens and by
transformers 5.25 (`apply_chat_template`, the reference), on the tiny test tokenizer. Templates with
a `{% generation %}` block (TRL's assistant-only loss puts it in fine-tuned models' templates), and
`tojson` with its options. Run from the repository root:
    PYTHONPATH=tests .venv/bin/python docs/testing/probe45/chat_template.py
"""

import tempfile
from pathlib import Path

import transformers
from tiny_models import write_tokenizer_json

from kvlens.models.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]
TEMPLATES = {
    "generation block": "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n"
    "{% endfor %}",
    "tojson options": "{{ messages | tojson(indent=2, sort_keys=True, separators=(',', ' = ')) }}|{{ messages[0] | tojson }}",
}
root = Path(tempfile.mkdtemp())
write_tokenizer_json(root)
hf = transformers.AutoTokenizer.from_pretrained(str(root))
ours = Tokenizer.from_hf_dir(root)
for label, template in TEMPLATES.items():
    want = hf.apply_chat_template(
        MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=False
    )
    ours.chat_template = template
    try:
        got = ours.apply_chat_template(MESSAGES, add_generation_prompt=False)
        print(f"{label}: {'same as transformers' if got == want else f'DIFFERS: {got!r} vs {want!r}'}")
    except Exception as e:  # what a user would see
        print(f"{label}: {type(e).__name__}: {e}")
