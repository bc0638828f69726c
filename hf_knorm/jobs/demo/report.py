"""The demo's report: one self-contained HTML page (images embedded as data URIs, no external resource).

Each step of the demo returns a :class:`Section`; :func:`write_report` renders them in order, each opening with one
sentence that says what the reader should look at, followed by its figures, tables, settings and timing.
"""

from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass, field
from pathlib import Path

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #1d1d1f; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
.look { background: #f2f6fb; border-left: 4px solid #3b7dd8; padding: 0.6em 0.9em; }
.meta { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; display: block; max-width: 100%;
        overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.85em; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
"""


@dataclass
class Table:
    """A table of the report: ``columns`` names, ``rows`` of cells (numbers are right-aligned)."""

    columns: list[str]
    rows: list[list]
    caption: str = ""


@dataclass
class Section:
    """One step of the demo, as the report shows it.

    Attributes:
        title: the heading.
        look_at: one sentence: what the reader should look at, and what it shows.
        figures: ``(path to a PNG, caption)`` pairs, embedded in the page.
        tables: the step's tables.
        text: optional preformatted text (e.g. a command, a file listing).
        settings: the settings the step ran with.
        seconds: how long the step took.
    """

    title: str
    look_at: str
    figures: list[tuple[Path, str]] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    text: str = ""
    settings: dict = field(default_factory=dict)
    seconds: float = 0.0


def write_report(sections: list[Section], path: str | Path, title: str, summary: dict) -> Path:
    """Render ``sections`` into one self-contained HTML file at ``path`` (written atomically); returns the path.

    Args:
        sections: the steps, in order.
        path: the HTML file to write.
        title: the page's heading.
        summary: key/value facts shown under the heading (model, versions, total time, ...).
    """
    path = Path(path)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><link rel=\"icon\" href=\"data:,\"><style>{_STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        '<p class="meta">' + " &middot; ".join(f"{_e(k)}: {_e(v)}" for k, v in summary.items()) + "</p>",
        "<ol>" + "".join(f'<li><a href="#step-{i}">{_e(s.title)}</a></li>' for i, s in enumerate(sections, 1))
        + "</ol>",
    ]
    for i, section in enumerate(sections, 1):
        parts.append(_render_section(i, section))
    parts.append("</body></html>")
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(parts), encoding="utf-8")
    os.replace(partial, path)
    return path


def _render_section(index: int, section: Section) -> str:
    parts = [f'<section id="step-{index}"><h2>{index}. {_e(section.title)}</h2>',
             f'<p class="look">{_e(section.look_at)}</p>']
    for figure, caption in section.figures:
        data = base64.b64encode(Path(figure).read_bytes()).decode("ascii")
        parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{_e(caption)}">'
                     f"<figcaption>{_e(caption)}</figcaption></figure>")
    for table in section.tables:
        parts.append(_render_table(table))
    if section.text:
        parts.append(f"<pre>{_e(section.text)}</pre>")
    settings = ", ".join(f"{k}={v}" for k, v in section.settings.items())
    parts.append(f'<p class="meta">Settings: {_e(settings or "defaults")}. Took {section.seconds:.1f} s.</p></section>')
    return "\n".join(parts)


def _render_table(table: Table) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in table.columns)
    body = "".join(
        "<tr>" + "".join(_cell(value) for value in row) + "</tr>" for row in table.rows
    )
    caption = f"<caption>{_e(table.caption)}</caption>" if table.caption else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value) -> str:
    if isinstance(value, float):
        return f'<td class="num">{value:.4g}</td>'
    if isinstance(value, int):
        return f'<td class="num">{value}</td>'
    return f"<td>{_e(value)}</td>"


def _e(value) -> str:
    return html.escape(str(value))
