"""The KLD report, whole, as llama-perplexity lays it out (``docs/lab-e2e.md`` shows one printed): a
hand-made statistics dict whose every figure is distinct, and the expected text written out here line
by line, so a swapped field, a mislabelled percentile, a lost unit or a lost blank line shows."""

from __future__ import annotations

from kvlens.lab.stats import format_kld_report

STATS = {
    "ppl_q": 22.5, "ppl_q_err": 0.875, "ppl_base": 22.25, "ppl_base_err": 0.8125, "cor_ln_ppl": 0.99875,
    "ln_ratio": 0.00125, "ln_ratio_err": 0.000625, "ppl_ratio": 1.00125, "ppl_ratio_err": 0.000626,
    "ppl_diff": 0.25, "ppl_diff_err": 0.015625,
    "kld_mean": 0.0012, "kld_mean_err": 0.0001, "kld_max": 0.4756, "kld_p999": 0.0404, "kld_p99": 0.0112,
    "kld_p95": 0.0037, "kld_p90": 0.0021, "kld_median": 0.0005, "kld_p10": 0.00008, "kld_p05": 0.00003,
    "kld_p01": 0.000004, "kld_p001": 0.0000004, "kld_min": -0.000001,
    "dp_mean": -0.018, "dp_mean_err": 0.013, "dp_max": 19.045, "dp_p999": 7.483, "dp_p99": 3.181,
    "dp_p95": 1.041, "dp_p90": 0.479, "dp_p75": 0.079, "dp_median": -0.0001, "dp_p25": -0.118,
    "dp_p10": -0.564, "dp_p05": -1.037, "dp_p01": -3.313, "dp_p001": -8.142, "dp_min": -13.602,
    "rms_dp": 0.997, "rms_dp_err": 0.049, "same_top_p": 98.159, "same_top_p_err": 0.176,
}  # fmt: skip

PPL_BLOCK = """\
====== Perplexity statistics ======
Mean PPL(Q)                   :  22.500000 ±   0.875000
Mean PPL(base)                :  22.250000 ±   0.812500
Cor(ln(PPL(Q)), ln(PPL(base))):  99.88%
Mean ln(PPL(Q)/PPL(base))     :   0.001250 ±   0.000625
Mean PPL(Q)/PPL(base)         :   1.001250 ±   0.000626
Mean PPL(Q)-PPL(base)         :   0.250000 ±   0.015625
"""

KLD_BLOCK = """\
====== KL divergence statistics ======
Mean    KLD:   0.001200 ±   0.000100
Maximum KLD:   0.475600
99.9%   KLD:   0.040400
99.0%   KLD:   0.011200
95.0%   KLD:   0.003700
90.0%   KLD:   0.002100
Median  KLD:   0.000500
10.0%   KLD:   0.000080
 5.0%   KLD:   0.000030
 1.0%   KLD:   0.000004
 0.1%   KLD:   0.000000
Minimum KLD:  -0.000001
"""

DP_BLOCK = """\
====== Token probability statistics ======
Mean    Δp: -0.018 ± 0.013 %
Maximum Δp: 19.045%
99.9%   Δp:  7.483%
99.0%   Δp:  3.181%
95.0%   Δp:  1.041%
90.0%   Δp:  0.479%
75.0%   Δp:  0.079%
Median  Δp: -0.000%
25.0%   Δp: -0.118%
10.0%   Δp: -0.564%
 5.0%   Δp: -1.037%
 1.0%   Δp: -3.313%
 0.1%   Δp: -8.142%
Minimum Δp: -13.602%
RMS Δp    :  0.997 ± 0.049 %
Same top p: 98.159 ± 0.176 %
"""


def test_the_three_blocks_each_followed_by_a_blank_line() -> None:
    assert format_kld_report(STATS) == PPL_BLOCK + "\n" + KLD_BLOCK + "\n" + DP_BLOCK


def test_a_block_whose_keys_are_absent_is_left_out() -> None:
    kld_only = {k: v for k, v in STATS.items() if k.startswith("kld_")}
    assert format_kld_report(kld_only) == KLD_BLOCK
