"""``lab ppl``'s printed protocol, tables and per-mode blocks, by hand, on ``test_lab_ppl``'s fake
model (token ids are the text's integers; logits at chunk position p are [p + 0.5 (q8), 0, 0, 0]),
whose perplexities are known in closed form."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from test_lab_ppl import _FakeLLM, _nll0

from kvlens.lab.ppl import MIRROR_NOTE, PplConfig, run_ppl
from kvlens.lab.ppl_report import describe, format_text, mode_header, summary_rows, weights_rows


def result(kv: list[str], add_bos: bool = True):
    # BOS + 13 zeros = 14 tokens -> 2 chunks of 6; positions 3 and 4 of each are scored
    return run_ppl(_FakeLLM(add_bos=add_bos), " ".join(["0"] * 13), PplConfig(ctx=6, kv=kv, prefill_chunk=2))


def test_the_protocol_in_words():
    r = result(["q8"])
    assert describe(r)[1:4] == [
        "ctx 6: 2 of 2 chunks, first token of every chunk replaced by BOS (id 7)",
        "scored: second half of each chunk, positions 3..4 predict tokens 4..5 -> 2 per chunk, 4 in total",
        "base f32: prefilled in one pass (f32 storage is chunk-invariant)",
    ]
    assert "(id 0)" in describe(replace(r, bos_id=0))[1]  # BOS id 0 is a BOS
    assert describe(replace(r, bos_id=None))[1].endswith("no BOS (the tokenizer adds none)")
    assert describe(replace(r, base_prefill_chunk=2))[3] == (
        "base f32: prefilled in sub-chunks of 2 tokens, like the test modes"
    )


def test_the_summary_rows_by_hand():
    r = replace(result(["q8", "q8+mirror"]), base_seconds=2.0, base_bytes_per_token=4321)
    ppl_b = math.exp(np.mean([_nll0(3), _nll0(4)]))
    ppl_q = math.exp(np.mean([_nll0(3.5), _nll0(4.5)]))
    headers, rows = summary_rows(r)
    assert headers[2:5] == ["PPL", "ΔPPL", "PPL ratio"]
    assert rows[0][:3] == ["f32 (base)", 4321, f"{ppl_b:.4f}"]
    assert rows[0][-1] == "6"  # 2 chunks x 6 tokens in 2 s
    q8, mirror = rows[1], rows[2]
    assert q8[0] == "q8" and q8[2] == f"{ppl_q:.4f}" and q8[4] == f"{ppl_q / ppl_b:.5f}"
    assert q8[3].startswith(f"{ppl_q - ppl_b:+.5f} ± ") and q8[3][0] == "-"  # q8's shift lowers PPL here
    kld = r.modes[0].stats
    assert q8[5] == f"{kld['kld_mean']:.3e} ± {kld['kld_mean_err']:.1e}" and q8[6] == f"{kld['kld_p99']:.3e}"
    assert kld["kld_mean"] != kld["kld_p99"]
    assert mirror[0] == "q8+mirror *" and mirror[2] == f"{ppl_b:.4f}"  # the fake shifts only "q8"


def test_each_mode_s_block_names_its_own_settings_and_note():
    r = result(["q8", "q8+mirror"])
    q8, mirror = r.modes
    assert mode_header(r, replace(q8, prefill_chunk=5)).endswith("prefill sub-chunk 5; base f32) ===")
    text = format_text(r)
    assert f"NOTE: q8+mirror {MIRROR_NOTE}" in text and "NOTE: q8 " not in text
    assert mirror.note == MIRROR_NOTE


def test_the_reference_row_shows_bytes_only_for_an_f32_base():
    """The f32-weights reference runs an f32 cache: its bytes are the base's only when the base is f32."""
    r = replace(result(["q8"]), base_bytes_per_token=4321, ref_seconds=1.0)
    r = replace(r, vs_f32_weights=list(r.modes))
    assert weights_rows(r)[1][0][1] == 4321
    assert weights_rows(replace(r, base="f16"))[1][0][1] == ""
