"""The table of worst values per layer and tensor (markdown), printed by `fp8_stats` at fit end
and by `foundry-fp8 report`, the escaping any layer name needs in markdown, and the bounded,
distinct labels a table, list or plot shows for names of any length. Plain Python."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping

import regex

from foundry_fp8.health.specs import SPECS, known_first, spec

#: The table's leading columns; other ranked statistics follow in SPECS' order.
COLUMNS = ("underflow_pct", "overflow_pct", "rel_mse", "cos_sim", "scale_ratio", "amax")


def plural(count: int, word: str) -> str:
    """`1 step`, `2 steps`: a count and its noun (a regular plural), for the runtime's warnings
    and the report alike."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def md_escape(text: str) -> str:
    """Text safe in a markdown table cell or line (not inside a code span): one line, no HTML
    (`<` and `&` escaped; a `>` opens no tag and stays, since the same table is printed to the
    console, where `&gt;` would show), `|`, `\\` and backticks escaped."""
    escaped = one_line(text).replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;")
    return escaped.replace("|", "\\|").replace("`", "\\`")


def md_code(text: str) -> str:
    """`text` as a code span (backslashes stay literal), or escaped text when it holds a
    backtick or a line break, which a code span cannot hold."""
    if "`" in text or "\n" in text or "\r" in text or "|" in text:
        return md_escape(text)
    return f"`{text}`"


#: The most characters of a name (layer, tensor kind, statistic) a table, list or plot shows: a
#: layer's name is about 40 (`blocks.11.ffn.down_proj` without its prefix); a longer one (a
#: 1 MB name in a hostile metrics.jsonl) keeps its start and its distinctive end around `...`.
LABEL_CHARS = 80
ELISION = "..."


#: What would break a one-line message or label, or drive a terminal: C0 and C1 control
#: characters (newline, carriage return, tab, ESC, DEL, NEL), Unicode's line and paragraph
#: separators (no font has a glyph for them either), and its format characters (category Cf:
#: the bidi overrides and isolates such as U+202E, which reorder the rest of a line, zero-width
#: spaces and joiners), which would make a name read as another.
_CONTROL = regex.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\p{Cf}]")


def one_line(text: str) -> str:
    """`text` for one line of output or a label: its control characters escaped as Python
    writes them (`new\\nline.yaml`, `\\x1b`), the rest as is. Every name or path a user chose
    goes through it in a one-line message (JSON and SARIF escape them themselves)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def elide(text: str, limit: int = LABEL_CHARS, mark: str = ELISION) -> str:
    """`text` whole when it has at most `limit` characters, else its first quarter and its end
    around `mark`, `limit` characters in all: the end is what tells layers apart."""
    if len(text) <= limit:
        return text
    room = max(limit - len(mark), 2)
    head = room // 4
    return text[:head] + mark + text[len(text) - (room - head):]


def bounded(text: str, limit: int = LABEL_CHARS) -> str:
    """A name (or a text holding one) as shown: one printable line, elided to `limit`."""
    return elide(one_line(text), limit)


def distinct_labels(names: Iterable[str], show: Callable[[str], str], limit: int = LABEL_CHARS,
                    sep: str = " #") -> dict[str, str]:
    """name -> `elide(show(name))`, each name's label its own: where two names would share one
    (the same start and end around an elided middle, or `show` joining what differed), each
    gets its name's short hash (and a count, were two hashes alike) after `sep`, inside the
    elision mark when elided (`blocks...#5b7049...ffn.down_proj`): never a label another name
    has, and still its name's end."""
    names = list(dict.fromkeys(names))
    shown = {name: show(name) for name in names}
    first = {name: elide(text, limit) for name, text in shown.items()}
    counts = Counter(first.values())
    taken = {label for label in first.values() if counts[label] == 1}
    labels = {}
    for name in names:
        label, text = first[name], shown[name]
        if counts[label] > 1:
            digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:6]
            for k in itertools.count(1):
                tag = digest if k == 1 else f"{digest}-{k}"
                label = (elide(text, limit, f"{ELISION}{sep.strip()}{tag}{ELISION}")
                         if len(text) > limit else f"{text}{sep}{tag}")
                if label not in taken:
                    break
            taken.add(label)
        labels[name] = label
    return labels


def short_names(names: Iterable[str], prefix: str = "", limit: int = LABEL_CHARS
                ) -> dict[str, str]:
    """name -> its label: one line, without `prefix`, at most about `limit` characters, and
    distinct for distinct names (`distinct_labels`)."""
    return distinct_labels(names, lambda name: one_line(name.removeprefix(prefix)), limit)


#: The number a flag's rule in words compares its value with: `> 5 %`, `< 0.99`, `> 0.01 % with
#: scale_ratio ...`, `rising 3 logging steps in a row, to > 1 %` (none in the NaN/Inf rule's).
LIMIT_NUMBER = regex.compile(r"[<>]=? (-?\d+(?:\.\d*)?(?:e[+-]?\d+)?)")


def limit_number(limit: str | None) -> float | None:
    """The number in a flag's rule in words (`LIMIT_NUMBER`), None where it holds none."""
    match = LIMIT_NUMBER.search(limit or "")
    return float(match[1]) if match else None


def number(value: float, limit: float | None = None, digits: int = 4) -> str:
    """A short number (`digits` significant digits); never raises (NaN, inf and 1e308 print as
    such). Beside a `limit` it is flagged against, the fewest digits more that keep it printed on
    its side of the limit and not as it: 0.99966 against 0.9997 printed "0.9997 (< 0.9997)",
    read as a wrong flag."""
    for shown_digits in range(digits, 18):  # 17 digits print any float64 exactly
        text = f"{value:.{shown_digits}g}"
        shown = float(text)
        if limit is None or value == limit or ((shown < limit) == (value < limit)
                                               and shown != limit):
            break
    return text


#: How the table marks a row all of whose worst values are what-if ones (`render_table`'s `cells`).
WHATIF_MARK = "(what-if)"
#: A row some of whose worst values, not all, are what-if ones (`render_table`'s `cells`).
PARTLY_WHATIF_MARK = "(what-if in part)"


def table_order(table: Mapping[tuple[str, str], Mapping[str, float]]) -> list[tuple[str, str]]:
    """The table's rows in the order it shows them: worst underflow first."""
    return sorted(table, key=lambda key: -_sortable(table[key].get("underflow_pct", 0.0)))


def render_table(table: Mapping[tuple[str, str], Mapping[str, float]],
                 cells: Collection[tuple[str, str, str]] = (),
                 only: Collection[tuple[str, str]] | None = None) -> str:
    """The worst value of each statistic per layer and tensor, worst underflow first; empty
    when nothing was judged. `scale_ratio` is the one farthest from 1 (> 1: tensor outgrew its
    scale, overflow side; < 1: scale too small, underflow side). `cells` names the (layer,
    tensor, stat) whose worst value only what-if numbers reached (a layer not in FP8 at those
    judged steps: never converted, or in fp8_guard's fallback), not the layer's FP8 casts; a
    row's mark says that of its shown values: all of them `(what-if)`, some `(what-if in
    part)`, none no mark. `only`: the rows shown (the terminal's cut of a wide run's table),
    with the whole table's columns and labels."""
    if not table:
        return ""
    present = {s for row in table.values() for s in row}
    extra = [s for s in known_first(present - set(COLUMNS), SPECS)
             if spec(s).worse and s != "mse"
             and not (spec(s).quiet_when_zero and all(row.get(s, 0) == 0 for row in table.values()))]
    columns = [*(c for c in COLUMNS if c in present), *extra]
    layers = short_names(layer for layer, _ in table)
    tensors = short_names(tensor for _, tensor in table)
    heads = short_names(columns)
    lines = ["| layer | tensor | " + " | ".join(md_escape(heads[c]) for c in columns) + " |",
             "|" + "---|" * (len(columns) + 2)]
    for layer, tensor in table_order(table):
        if only is not None and (layer, tensor) not in only:
            continue
        row = table[(layer, tensor)]
        values = " | ".join(number(row.get(c, float("nan"))) for c in columns)
        kind = md_escape(tensors[tensor]) + _mark(layer, tensor, row, columns, cells)
        lines.append(f"| {md_escape(layers[layer])} | {kind} | {values} |")
    return "\n".join(lines) + "\n"


def _mark(layer: str, tensor: str, row: Mapping[str, float], columns: list[str],
          cells: Collection[tuple[str, str, str]]) -> str:
    """A row's what-if mark (`render_table`), from the values the row has: a column another
    row brought is blank (nan) in it, neither what-if nor not."""
    shown = [(layer, tensor, c) in cells for c in columns if c in row]  # its own values only
    if not any(shown):  # none what-if, or none of its values shown (e.g. only `mse`)
        return ""
    return f" {WHATIF_MARK}" if all(shown) else f" {PARTLY_WHATIF_MARK}"


def _sortable(value: float) -> float:
    return value if value == value else -1.0
