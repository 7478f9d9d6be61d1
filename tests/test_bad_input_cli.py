"""The ``kvlens`` command's error boundary and parse-time option checks.

Parse-time cases run the real entry point (``kvlens.cli.main`` with a real argv) in this process;
cases that need a process of their own (undecodable argv bytes, a model load, ``--debug``) run
``python -m kvlens.cli`` as a subprocess. Either way: a non-zero exit, no traceback, nothing on
stdout, and one ``error:`` line (or click's usage message for a bad option value).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import write_hf

from kvlens import cli, cli_args
from kvlens.cli_args import MAX_SIZE, parse_floats, parse_sizes
from kvlens.engine import loading as loading_module


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["kvlens", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out, err = capsys.readouterr()
    return e.value.code, out, err


def assert_one_error_line(code: int, out: str, err: str, needle: str, exit_code: int = 2) -> None:
    assert code == exit_code, err
    assert out == "", out
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


BAD_OPTIONS = [
    (["generate", "--sparse-budget", "inf", "hi"], "--sparse-budget"),
    (["generate", "--sparse-budget", "nan", "hi"], "--sparse-budget"),
    (["generate", "--sparse-budget", "0", "hi"], "--sparse-budget"),
    (["generate", "--temperature", "nan", "hi"], "--temperature"),
    (["generate", "--temperature", "-1", "hi"], "--temperature"),
    (["generate", "--top-p", "inf", "hi"], "--top-p"),
    (["generate", "--top-p", "0", "hi"], "--top-p"),
    (["generate", "--device", "tpu", "hi"], "--device"),
    (["lab", "ppl", "--sparse-budget", "-inf"], "--sparse-budget"),
    (["lab", "unit", "--k-amp", "nan"], "--k-amp"),
    (["lab", "unit", "--seq-len", "64,,256"], "--seq-len"),
    (["lab", "unit", "--seq-len", "1k"], "--seq-len"),
    (["lab", "unit", "--amplitude", "1,inf"], "--amplitude"),
    (["lab", "unit", "--trials", "0"], "--trials"),
    (["lab", "unit", "--heads", "0"], "--heads"),
    (["lab", "needle", "--depth", "0.5,nan"], "--depth"),
    (["lab", "needle", "--depth", "1.5"], "--depth"),
    (["lab", "needle", "--sparse-budget", "0.25,-1"], "--sparse-budget"),
    (["bench", "attention", "--mem-gib", "inf"], "--mem-gib"),
    (["generate", "--attn-backend", "cuda-magic", "hi"], "--attn-backend"),
    (["generate", "--attn-backend", "numba-int:avx3", "hi"], "--attn-backend"),
    (["bench", "attention", "--sparse", "quest", "--sparse-budget", "1k,0"], "--sparse-budget"),
    (["bench", "serve", "--url", "ftp://127.0.0.1:8000"], "--url"),
    (["bench", "serve", "--url", "http://"], "--url"),
    (["serve", "--api-key", ""], "--api-key"),
    (["serve", "--api-key", "two words"], "--api-key"),
    (["serve", "--api-key", "kéy"], "--api-key"),
    *[
        (["bench", "decode", "--ctx", bad], "--ctx")
        for bad in ["", ",", "1,,2", "-1", "0", "1.5k", "k", "4k,x", "99999999999999k", "+5", "1e3"]
    ],
]


@pytest.mark.parametrize(("args", "option"), BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_values_are_usage_errors_before_anything_runs(monkeypatch, capsys, args, option):
    def no_load(*_args, **_kwargs):  # a value that slipped through must not start a run (serve: forever)
        raise RuntimeError("a model was loaded: the option passed its parse-time check")

    monkeypatch.setattr(loading_module, "load_model", no_load)
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    assert f"Invalid value for '{option}'" in err and "Usage:" in err, err


def test_device_cuda_without_cuda(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, out, err = run_main(monkeypatch, capsys, "generate", "--device", "cuda", "hi")
    assert code == 2 and out == "" and "not available" in err and "Traceback" not in err


WEIGHTS_ERROR = "unknown weights mode 'int3'; expected auto, f32, bf16, int8, int4"
BAD_CONFIGS = [
    (["lab", "ppl", "--weights", "int3"], WEIGHTS_ERROR),
    (["lab", "greedy", "--weights", "int3"], WEIGHTS_ERROR),
    (["lab", "layers", "--weights", "int3"], WEIGHTS_ERROR),
    (["lab", "needle", "--weights", "int3"], WEIGHTS_ERROR),
    (["bench", "decode", "--no-hf", "--weights", "f32,int3"], "unknown weights mode 'int3'"),
    (["bench", "decode", "--no-hf", "--kv", "f16,q7"], "unknown KV cache mode 'q7'"),
    (["bench", "decode", "--no-hf", "--vs-llama-cpp", "/nonexistent/llama-bench"], "llama-bench not found"),
    (["bench", "decode", "--no-hf", "--attn-backend", "numba,bogus"], "unknown attention backend 'bogus'"),
]


@pytest.mark.parametrize(("args", "needle"), BAD_CONFIGS, ids=[" ".join(a) for a, _ in BAD_CONFIGS])
def test_bad_config_is_one_error_line_before_a_model_loads(monkeypatch, capsys, args, needle):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the command's config was checked")

    monkeypatch.setattr("kvlens.load", load)
    assert_one_error_line(*run_main(monkeypatch, capsys, *args), needle)


@pytest.mark.parametrize(
    ("raised", "exit_code", "needle"),
    [
        (ValueError("bad\n  value"), 2, "error: bad value"),
        (FileNotFoundError(2, "No such file", "x.txt"), 2, "No such file"),
        (KeyError("auto"), 1, "internal error (KeyError: 'auto'); rerun with --debug"),
        (RuntimeError("kernel exploded"), 1, "internal error (RuntimeError: kernel exploded)"),
        (AssertionError(), 1, "internal error (AssertionError: AssertionError)"),
    ],
)
def test_any_exception_becomes_one_line(monkeypatch, capsys, raised, exit_code, needle):
    def load(*args, **kwargs):
        raise raised

    monkeypatch.setattr("kvlens.load", load)
    monkeypatch.delenv(cli_args.DEBUG_ENV, raising=False)
    assert_one_error_line(*run_main(monkeypatch, capsys, "generate", "hi"), needle, exit_code)


def test_ctrl_c_exits_130_quietly(monkeypatch, capsys):
    def load(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvlens.load", load)
    code, out, err = run_main(monkeypatch, capsys, "generate", "hi")
    assert (code, out, err.strip()) == (130, "", "")


def test_debug_prints_the_traceback_then_the_line(monkeypatch, capsys):
    def load(*args, **kwargs):
        raise KeyError("auto")

    monkeypatch.setattr("kvlens.load", load)
    monkeypatch.setenv(cli_args.DEBUG_ENV, "0")  # off; --debug turns it on, monkeypatch restores it
    code, out, err = run_main(monkeypatch, capsys, "--debug", "generate", "hi")
    assert code == 1 and out == ""
    assert (
        err.startswith("Traceback")
        and err.strip().splitlines()[-1] == "error: internal error (KeyError: 'auto')"
    )


# -- through a real process ------------------------------------------------------------------------
def kvlens(*args: str | bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvlens.cli", *args],
        capture_output=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def one_line(r: subprocess.CompletedProcess, needle: str) -> None:
    assert_one_error_line(r.returncode, r.stdout.decode(), r.stderr.decode(), needle)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "hf"
    write_hf("qwen2", path)  # context 256 tokens
    return path


def test_process_refuses_before_printing(tiny_dir, tmp_path):
    # a prompt that does not fit: nothing echoed to stdout first
    one_line(
        kvlens("generate", "--model", str(tiny_dir), "--kv", "f32", "a b " * 200),
        "do not fit in the model's context",
    )
    # a prompt that fits, but not with the tokens asked for
    one_line(kvlens("generate", "--model", str(tiny_dir), "--max-tokens", "250", "a b c d e f"), "256 tokens")
    # malformed config.json value, named by its key
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": "2"}))
    one_line(kvlens("generate", "--model", str(bad), "hi"), "num_hidden_layers must be an integer, got str")


def test_process_undecodable_prompt_bytes_and_parse_time_inf():
    r = kvlens("generate", b"caf\xe9 \xff")  # argv bytes that are not UTF-8
    assert r.returncode == 2 and r.stdout == b"" and b"Traceback" not in r.stderr
    assert b"not valid UTF-8" in r.stderr
    r = kvlens("generate", "--sparse", "quest", "--sparse-budget", "inf", "hi")
    assert r.returncode == 2 and r.stdout == b"" and b"Traceback" not in r.stderr
    assert b"finite" in r.stderr


def test_process_debug_env_shows_the_traceback(tmp_path):
    r = kvlens("generate", "--model", str(tmp_path / "none.gguf"), "hi", env={cli_args.DEBUG_ENV: "1"})
    err = r.stderr.decode()
    assert (
        r.returncode == 2
        and "Traceback" in err
        and err.strip().splitlines()[-1].startswith("error: model not found")
    )


# -- the parsers, property-tested -------------------------------------------------------------------
def render(n: int, draw_k: bool, upper: bool, pad: bool) -> str:
    text = f"{n // 1024}{'K' if upper else 'k'}" if draw_k and n % 1024 == 0 else str(n)
    return f" {text} " if pad else text


@pytest.mark.parametrize(
    ("text", "minimum", "maximum"), [("4", 5, 8), ("9", 5, 8), ("1k", 1, 1023), ("8,9", 1, 8)]
)
def test_parse_sizes_keeps_each_item_within_its_bounds(text, minimum, maximum):
    with pytest.raises(ValueError, match=rf"outside \[{minimum}, {maximum}\]"):
        parse_sizes(text, minimum, maximum)
    assert parse_sizes(str(maximum), minimum, maximum) == [maximum]
    assert parse_sizes(str(minimum), minimum, maximum) == [minimum]


@settings(deadline=None)  # a shared, loaded box must not turn slowness into failure
@given(st.lists(st.tuples(st.integers(1, MAX_SIZE), st.booleans(), st.booleans(), st.booleans()), min_size=1))
def test_parse_sizes_reads_back_what_was_written(items):
    text = ",".join(render(*item) for item in items)
    assert parse_sizes(text) == [n for n, *_ in items]


def reference_size(item: str) -> int | None:
    """Independent reading of one item: decimal digits with an optional k/K suffix, 1..MAX_SIZE."""
    item = item.strip()
    factor = 1024 if item[-1:] in ("k", "K") else 1
    digits = item[:-1] if factor == 1024 else item
    if not digits or not all(c in "0123456789" for c in digits) or len(digits) > 12:
        return None
    value = int(digits) * factor
    return value if 1 <= value <= MAX_SIZE else None


@settings(deadline=None)  # a shared, loaded box must not turn slowness into failure
@given(st.text(alphabet="0123456789kK,.-+e ", max_size=24))
@example("2147483647")  # MAX_SIZE itself, then one past it, plainly and with k
@example("2147483648")
@example("2097152k")
@example("512,2097152K")
def test_parse_sizes_accepts_exactly_the_grammar(text):
    expected = [reference_size(item) for item in text.split(",")]
    if None in expected:
        with pytest.raises(ValueError):
            parse_sizes(text)
    else:
        assert parse_sizes(text) == expected


@settings(deadline=None)  # a shared, loaded box must not turn slowness into failure
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=4))
def test_parse_floats_takes_finite_values_in_range_only(values):
    text = ",".join(repr(v) for v in values)
    if all(math.isfinite(v) and 0 <= v <= 1 for v in values):
        assert parse_floats(text, 0.0, 1.0) == values
    else:
        with pytest.raises(ValueError):
            parse_floats(text, 0.0, 1.0)


@settings(deadline=None)  # a shared, loaded box must not turn slowness into failure
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_budget_option_takes_finite_positive_numbers_only(value):
    import typer

    if math.isfinite(value) and value > 0:
        assert cli_args.budget_option(value) == value
    else:
        with pytest.raises(typer.BadParameter):
            cli_args.budget_option(value)


def test_output_paths_and_empty_prompt_are_refused_before_the_run(monkeypatch, capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["lab", "ppl", "--report", str(a_file)], "--report", "exists and is not a directory"),
        (["lab", "greedy", "--report", str(a_file / "sub")], "--report", "is not a directory"),
        (["lab", "unit", "--plot", str(tmp_path)], "--plot", "exists and is a directory"),
        (["lab", "needle", "--plot", str(a_file / "x.png")], "--plot", "is not a directory"),
        (["generate", ""], "prompt", "the prompt is empty"),
        (["lab", "sweep", str(a_file), "--db", str(tmp_path)], "--db", "exists and is a directory"),
        (["serve", "--kv-disk", str(a_file)], "--kv-disk", "exists and is not a directory"),
    ]
    for args, option, needle in cases:
        code, out, err = run_main(monkeypatch, capsys, *args)
        assert code == 2 and out == "" and "Traceback" not in err, err
        assert f"Invalid value for '{option}'" in err and needle in " ".join(err.replace("│", "").split()), (
            err
        )


def test_a_server_url_nothing_answers_is_one_error_line(monkeypatch, capsys):
    from kvlens.serve.process import free_port

    url = f"http://127.0.0.1:{free_port()}"  # bound and released: nothing listens there
    args = ("bench", "serve", "--url", url, "--requests", "1", "--concurrency", "1")
    assert_one_error_line(*run_main(monkeypatch, capsys, *args), f"cannot reach a server at {url}")


def test_a_record_that_is_not_one_is_one_error_line(monkeypatch, capsys, tmp_path):
    (tmp_path / "half.json").write_text('{"kvlens": ')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "latin1.json").write_bytes(b'{"\xe9": 1}')
    cases = [
        (tmp_path / "missing.json", "cannot read the record"),
        (tmp_path, "cannot read the record"),
        (tmp_path / "half.json", "half.json is not valid JSON: Expecting value (line 1, column 12)"),
        (tmp_path / "latin1.json", "latin1.json is not valid JSON: not UTF-8 text"),
        (tmp_path / "list.json", "not a kvlens record"),
    ]
    for path, needle in cases:
        assert_one_error_line(*run_main(monkeypatch, capsys, "verify", str(path)), needle)


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(monkeypatch, capsys):
    import socket

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr("kvlens.load", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_main(monkeypatch, capsys, "serve", "--port", str(port))
    assert_one_error_line(code, out, err, f"cannot listen on 127.0.0.1:{port}")
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is never an address of this machine
    code, out, err = run_main(monkeypatch, capsys, "serve", "--host", "192.0.2.1", "--port", "0")
    assert_one_error_line(code, out, err, "cannot listen on 192.0.2.1:0")


def test_corpus_that_is_not_a_file_is_called_so(tmp_path):
    from kvlens.corpus import CorpusError, load_corpus

    with pytest.raises(CorpusError, match="is not a regular file"):
        load_corpus(str(tmp_path))
