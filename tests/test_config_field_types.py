"""Every command's config refuses a value of the wrong type in a field, naming its CLI option, and
the values the CLI checks with its callbacks (sizes, URLs, API keys, rates, weights, budgets, seeds,
candidate kinds) as the CLI does (thirty-eighth session's hostile sweep: ``warmup="no"`` read as
true, ``rate=-1`` or ``1e-300``, ``api_key=""`` opening a server, a 400-digit size overflowing)."""

from __future__ import annotations

import dataclasses

import pytest
from test_config_ranges import CONFIGS as COMMAND_CONFIGS

from kvlens.bench.attention import AttentionBenchConfig
from kvlens.bench.engine_decode import EngineBenchConfig
from kvlens.bench.serve import ServeBenchConfig
from kvlens.engine.generate import GenerateConfig
from kvlens.lab.greedy import GreedyConfig
from kvlens.lab.layers import LayersConfig
from kvlens.lab.needle import NeedleConfig
from kvlens.lab.plan import PlanConfig
from kvlens.lab.ppl import PplConfig
from kvlens.lab.unit import UnitConfig
from kvlens.serve.cli import ServeConfig, parse_size

# every command's config (test_config_ranges.CONFIGS: the one list, checked against the CLI there),
# and what each needs besides its defaults
REQUIRED = dict(COMMAND_CONFIGS.values())
CONFIGS = list(REQUIRED)
# a value of another type for each scalar annotation, and the words the refusal uses
WRONG = {"bool": ("no", "True or False"), "int": (1.5, "an integer"), "float": ("x", "a number"),
         "str": (5, "a string")}  # fmt: skip


def scalar_fields():
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            kind = str(f.type).replace(" ", "").removesuffix("|None")
            if kind in WRONG:
                yield pytest.param(cls, f.name, kind, id=f"{cls.__name__}.{f.name}")


def required_scalar_fields():
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            if str(f.type).replace(" ", "") in WRONG:  # no "| None": None is not a value there
                yield pytest.param(cls, f.name, id=f"{cls.__name__}.{f.name}")


@pytest.mark.parametrize(("cls", "name"), list(required_scalar_fields()))
def test_none_is_refused_where_the_field_is_not_optional(cls, name):
    with pytest.raises(TypeError, match=f"^--{name.replace('_', '-')} must be .*, got NoneType None$"):
        cls(**{**REQUIRED.get(cls, {}), name: None})


def test_every_config_has_scalar_fields_to_check():
    assert len(list(scalar_fields())) > 100


@pytest.mark.parametrize(("cls", "name", "kind"), list(scalar_fields()))
def test_a_field_of_the_wrong_type_is_named_as_its_option(cls, name, kind):
    value, words = WRONG[kind]
    option = "--" + name.replace("_", "-")
    with pytest.raises(TypeError, match=f"^{option} must be {words}, got "):
        cls(**{**REQUIRED.get(cls, {}), name: value})


@pytest.mark.parametrize(
    ("cls", "changes", "error", "said"),
    [
        (ServeConfig, {"api_key": ""}, ValueError, "the API key is empty"),
        (ServeConfig, {"api_key": "a b"}, ValueError, "printable ASCII without spaces"),
        (ServeConfig, {"kv_budget": ""}, ValueError, "--kv-budget: bad size ''"),
        (ServeConfig, {"kv_budget": "9" * 400}, ValueError, "--kv-budget: bad size .* too large"),
        (ServeConfig, {"kv_disk_budget": "0"}, ValueError, "--kv-disk-budget: bad size '0': must be more"),
        (ServeConfig, {"weights": "int3"}, ValueError, "unknown weights mode 'int3'"),
        (ServeBenchConfig, {"rate": -1.0}, ValueError, "--rate must be ≥ 0.001, got -1"),
        (ServeBenchConfig, {"rate": 1e-300}, ValueError, "--rate must be ≥ 0.001"),
        (ServeBenchConfig, {"rate": float("nan")}, ValueError, "--rate must be a finite number"),
        (ServeBenchConfig, {"url": "ftp://x"}, ValueError, "expected an http:// or https:// URL"),
        (ServeBenchConfig, {"weights": "int3"}, ValueError, "unknown weights mode 'int3'"),
        (ServeBenchConfig, {"kv_budget": "bogus"}, ValueError, "--kv-budget: bad size 'bogus'"),
        (ServeBenchConfig, {"concurrency": [2**70]}, ValueError, "--concurrency must be ≤ 2147483647"),
        (ServeBenchConfig, {"concurrency": [0]}, ValueError, "--concurrency must be ≥ 1, got 0"),
        (NeedleConfig, {"sparse_budget": [-1.0]}, ValueError, "--sparse-budget must be > 0"),
        (NeedleConfig, {"sparse_budget": [0.0]}, ValueError, "--sparse-budget must be > 0"),
        (NeedleConfig, {"sparse_budget": [float("inf")]}, ValueError, "--sparse-budget must be a finite"),
        (NeedleConfig, {"sparse": "bogus"}, ValueError, "unknown sparse method 'bogus'"),
        (UnitConfig, {"seq_len": [2**40]}, ValueError, "--seq-len must be ≤ 2147483647"),
        (GenerateConfig, {"prompt": "Hi", "seed": 2**70}, ValueError, "seed must be ≤ 18446744073709551615"),
        (GenerateConfig, {"prompt": "Hi", "weights": ""}, ValueError, "unknown weights mode ''"),
        (PlanConfig, {"candidates": 5}, TypeError, "--candidates must be a list of KV kinds, got int"),
        (PlanConfig, {"candidates": ["q8", 5]}, TypeError, "--candidates must name KV kinds, got int 5"),
        (PlanConfig, {"candidates": ["q8h", "q8h"]}, ValueError, "--candidates names a kind twice"),
        (AttentionBenchConfig, {"threads": 2**70}, ValueError, "--threads must be ≤ 2147483647"),
        (EngineBenchConfig, {"prompt_len": 2**70}, ValueError, "--prompt-len must be ≤ 2147483647"),
    ],
)
def test_values_the_cli_checks_are_checked_by_the_config(cls, changes, error, said):
    with pytest.raises(error, match=said):
        cls(**changes)


def test_sizes_parse_as_the_cli_reads_them():
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size(str(2**63 - 1024)) == 2**63 - 1024  # the largest float below 2**63, exactly
    with pytest.raises(ValueError, match="too large"):
        parse_size(str(2**63))


@pytest.mark.parametrize(
    ("cls", "changes", "error", "said"),
    [
        (GenerateConfig, {"prompt": "Hi", "kv": "bogus"}, ValueError, "unknown KV cache mode 'bogus'"),
        (GenerateConfig, {"prompt": "Hi", "attn_backend": "bogus"}, ValueError, "bogus"),
        (GenerateConfig, {"prompt": "Hi", "mirror_prefill": "bogus"}, ValueError, "mirror_prefill must be"),
        (GenerateConfig, {"prompt": "Hi", "device": "tpu"}, ValueError, "device 'tpu'"),
        (GenerateConfig, {"prompt": ""}, ValueError, "empty"),
        (ServeConfig, {"kv": "bogus"}, ValueError, "unknown KV cache mode 'bogus'"),
        (GreedyConfig, {"weights": "int3"}, ValueError, "unknown weights mode 'int3'"),
        (PplConfig, {"weights": "int3"}, ValueError, "unknown weights mode 'int3'"),
        (LayersConfig, {"weights": "int3"}, ValueError, "unknown weights mode 'int3'"),
    ],
)
def test_names_are_checked_before_a_model_loads(cls, changes, error, said):
    with pytest.raises(error, match=said):
        cls(**changes)
