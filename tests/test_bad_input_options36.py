"""Option values the thirty-sixth session's sweep found taken: refused when the command line is
parsed, as the other options' are (test_bad_input_cli's rule: exit 2, typer's usage error naming the
option, nothing on stdout, no model loaded). Before: `serve --graceful-s nan` (and -5, inf) served,
`--kv-budget ''` and `--weights ''` ran as the defaults, `bench serve --rate inf` passed, and
`bench serve --kv-budget abc` failed only once a server had been started."""

from __future__ import annotations

import pytest
from test_bad_input_cli import test_bad_option_values_are_usage_errors_before_anything_runs as refused

URL = ["--url", "http://127.0.0.1:9"]  # were a value let through: a refused connection, not a server start

CASES = [
    (["serve", "--graceful-s", "nan"], "--graceful-s"),
    (["serve", "--graceful-s", "-5"], "--graceful-s"),
    (["serve", "--graceful-s", "inf"], "--graceful-s"),
    (["serve", "--kv-budget", ""], "--kv-budget"),
    (["serve", "--kv-budget", "12 parsecs"], "--kv-budget"),
    (["serve", "--kv-budget", "12XB"], "--kv-budget"),
    (["serve", "--kv-disk", "d", "--kv-disk-budget", "0GiB"], "--kv-disk-budget"),
    (["serve", "--kv-disk-budget", "0MiB"], "--kv-disk-budget"),
    (["serve", "--weights", ""], "--weights"),
    (["generate", "--weights", "", "hi"], "--weights"),
    (["generate", "--weights", "int3", "hi"], "--weights"),
    (["bench", "serve", *URL, "--rate", "inf"], "--rate"),
    (["bench", "serve", *URL, "--rate", "0"], "--rate"),
    (["bench", "serve", *URL, "--kv-budget", "abc"], "--kv-budget"),
    (["bench", "serve", *URL, "--kv-disk-budget", "abc"], "--kv-disk-budget"),
    (["bench", "serve", *URL, "--weights", ""], "--weights"),
]


@pytest.mark.parametrize(("args", "option"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_refused_at_parse_time(monkeypatch, capsys, args, option):
    refused(monkeypatch, capsys, args, option)
