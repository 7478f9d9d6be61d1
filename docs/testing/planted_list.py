"""Write a planted-bug list for ``planted-serving24/run_planted.py``: each bug's text must occur once
in its file and the planted file must still compile, so no plant is a no-op or a SyntaxError."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_list(path: Path, bugs: list[tuple[str, str, str, str]]) -> None:
    """``bugs``: (id, file under the repo, old text, new text); written to ``path`` as JSON."""
    out = []
    for bug_id, file, old, new in bugs:
        src = (ROOT / file).read_text()
        assert src.count(old) == 1, (bug_id, src.count(old))
        compile(src.replace(old, new), file, "exec")
        out.append({"id": bug_id, "file": file, "old": old, "new": new})
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(path.name, len(out))
