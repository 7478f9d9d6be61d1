"""The rows and table of ``kvlens bench attention`` (:mod:`.attention` times them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .bandwidth import Bandwidth, machine_line
from .spread import MachineSpread, OtherLoad, Spread, machine_lines, spread_warning


@dataclass
class AttnRow:
    shape: str
    ctx: int
    mode: str
    backend: str
    us_per_call: float  # min over rounds
    us_median: float
    us_max: float  # the slowest round: with the min, how steady the figure is (Spread)
    bytes_read: int  # cache bytes for ctx positions (K + V rows + int8 scales)
    gb_per_s: float
    frac_of_copy_bw: float
    frac_of_read_bw: float
    x_vs_sdpa_f32: float | None  # t(torch-sdpa over f32) / t(this row)
    x_vs_dequant_sdpa: float | None  # t(dequant-sdpa of this mode, or torch-sdpa for f32) / t(this row)
    n_layers: int  # distinct layer caches rotated through
    threads: int
    device: str
    machine: MachineSpread | None = None  # the machine's own speed between this (shape, ctx)'s rounds

    @property
    def spread(self) -> Spread:
        return Spread(self.us_per_call, self.us_median, self.us_max)

    def as_dict(self) -> dict:
        return asdict(self) | {"spread": self.spread.rel}


def spread_warnings(rows: list[AttnRow], load: OtherLoad | None) -> list[str]:
    """A warning line for every row whose rounds disagree by more than :data:`WIDE_SPREAD`."""
    lines = (
        spread_warning(f"{r.shape} {r.ctx} {r.mode} {r.backend} µs/call", r.spread, load, machine=r.machine)
        for r in rows
    )
    return [line for line in lines if line]


def render(rows: list[AttnRow], bw: dict[str, Bandwidth]) -> None:
    from rich.console import Console
    from rich.table import Table

    machine = machine_lines(
        {f"{r.shape} ctx {r.ctx}": r.machine for r in rows if r.machine is not None}, "\n"
    )
    title = "decode attention, one layer per call (min, median, max over rounds)"
    t = Table(title=title, caption=f"{machine_line(bw)}\n{machine}")
    cols = ("shape", "ctx", "mode", "backend", "layers", "µs/call", "median", "max", "spread", "GB/s", "% copy", "% read",
            "× sdpa f32", "× dequant+sdpa")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="right")

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        t.add_row(r.shape, str(r.ctx), r.mode, r.backend, str(r.n_layers), f"{r.us_per_call:.0f}",
                  f"{r.us_median:.0f}", f"{r.us_max:.0f}", f"{r.spread.rel:.0%}", f"{r.gb_per_s:.2f}", f"{100 * r.frac_of_copy_bw:.0f}",
                  f"{100 * r.frac_of_read_bw:.0f}", x(r.x_vs_sdpa_f32), x(r.x_vs_dequant_sdpa))  # fmt: skip
    Console(width=max(Console().width, 130)).print(t)
