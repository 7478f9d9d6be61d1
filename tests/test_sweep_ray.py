"""The same tiny sweep through the local process pool and through a local Ray instance stores the
same statistics, bit for bit (only timings, workers and timestamps may differ)."""

from __future__ import annotations

import pytest
from test_sweep import PPL, stored, tiny_gguf, write_spec  # noqa: F401 - tiny_gguf is a fixture

from kvlens.lab.sweep import LocalExecutor, RayExecutor, run_sweep
from kvlens.lab.sweep_spec import load_spec

ray = pytest.importorskip("ray", reason="the Ray executor needs `pip install kvlens[cluster]`")

DETERMINISTIC = ("config_json", "status", "ppl_ratio", "ppl_ratio_err", "kld_mean", "kld_mean_err", "same_top_p",
                 "bytes_per_token")  # fmt: skip


def _comparable(row: dict) -> dict:
    """Everything the run computed: indexed columns and the lab's statistics (no timings)."""
    r = row["result"]
    out = {k: row[k] for k in DETERMINISTIC}
    if row["measurement"] == "ppl":
        out["stats"] = r["modes"][row["kv"]]["stats"]
    else:
        mode = r["modes"][row["kv"]]
        out["greedy"] = {k: mode[k] for k in ("agreement", "identical_prompts", "first_divergence")}
    return out


@pytest.mark.ray
def test_local_and_ray_store_identical_results(tmp_path, tiny_gguf):  # noqa: F811
    body = PPL + "[greedy]\nctx = [16]\nprompts = 2\ntokens = 4\n"
    spec = load_spec(write_spec(tmp_path, tiny_gguf, body, kv=["q8", "q8-v"], measurements=["ppl", "greedy"]))
    local_db, ray_db = tmp_path / "local.sqlite", tmp_path / "ray.sqlite"
    s = run_sweep(spec, local_db, LocalExecutor(1, 1), show_progress=False)
    assert (s.done, s.failed) == (4, [])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        s = run_sweep(spec, ray_db, RayExecutor(None, 1), show_progress=False)
    finally:
        ray.shutdown()
    assert (s.done, s.failed) == (4, [])
    local = {r["cell_key"]: r for r in stored(local_db)}
    on_ray = {r["cell_key"]: r for r in stored(ray_db)}
    assert set(local) == set(on_ray) == {c.key for c in spec.cells}
    assert all(r["worker"].startswith("ray:") for r in on_ray.values())
    assert all(r["worker"].startswith("local:") for r in local.values())
    for key, row in local.items():
        assert _comparable(row) == _comparable(on_ray[key]), row["config_json"]
