"""The table of worst values per layer and tensor (markdown), printed by `fp8_stats` at fit end
and by `foundry-fp8 report`, and the escaping any layer name needs in markdown. Plain Python."""

from __future__ import annotations

import html
from collections.abc import Mapping

from foundry_fp8.health.specs import SPECS, known_first, spec

#: The table's leading columns; other ranked statistics follow in SPECS' order.
COLUMNS = ("underflow_pct", "overflow_pct", "rel_mse", "cos_sim", "scale_ratio", "amax")


def md_escape(text: str) -> str:
    """Text safe in a markdown table cell or line: no HTML, `|` escaped, one line."""
    one_line = " ".join(text.splitlines()) if text else text
    return html.escape(one_line, quote=False).replace("|", "\\|").replace("`", "\\`")


def number(value: float) -> str:
    """A short number; never raises (NaN, inf and 1e308 print as such)."""
    return f"{value:.4g}"


def render_table(table: Mapping[tuple[str, str], Mapping[str, float]]) -> str:
    """The worst value of each statistic per layer and tensor, worst underflow first; empty
    when nothing was judged. `scale_ratio` is the one farthest from 1 (> 1: tensor outgrew its
    scale, overflow side; < 1: scale too small, underflow side)."""
    if not table:
        return ""
    present = {s for row in table.values() for s in row}
    extra = [s for s in known_first(present - set(COLUMNS), SPECS)
             if spec(s).worse and s != "mse"
             and not (spec(s).quiet_when_zero and all(row.get(s, 0) == 0 for row in table.values()))]
    columns = [*(c for c in COLUMNS if c in present), *extra]
    lines = ["| layer | tensor | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    for (layer, tensor), row in sorted(table.items(),
                                       key=lambda kv: -_sortable(kv[1].get("underflow_pct", 0.0))):
        values = " | ".join(number(row.get(c, float("nan"))) for c in columns)
        lines.append(f"| {md_escape(layer)} | {md_escape(tensor)} | {values} |")
    return "\n".join(lines) + "\n"


def _sortable(value: float) -> float:
    return value if value == value else -1.0
