"""Figures that cannot drift: every figure the README, docs/status.md and a ``--help`` text quote is on the results
page it links to, in the section the link names.

The results pages are ``BENCHMARKS.md``, ``docs/results/*.md`` and the dated ``docs/research/*.md``: each figure is
measured there, with its command. Elsewhere a figure is quoted in one of two marked forms:

- Markdown (README.md, docs/status.md): the figure is the text of a link to its page and section,
  ``[0.95x [0.95-0.96]](docs/results/conversion.md#the-default-conversion)``; every number of that text must be in
  that section. A figure (a number with a unit: ``1.08x``, ``87.5%``, ``47.5 min``, ``9 s``, ``93 MB``) outside such
  a link fails.
- ``--help`` (every command's description and flags): the text cites the page, ``(docs/results/knorm.md, 'Eviction
  scores')``, and each figure it holds must be in the cited section (the heading that starts with the quoted title).

The Makefile states no figure (its comments point to docs/status.md, "Setup, times and status").
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
from pymdownx.slugs import slugify

from hf_knorm.cli import COMMANDS, _build_parser

ROOT = Path(__file__).resolve().parents[1]
RESULT_PAGES = {ROOT / "BENCHMARKS.md", *(ROOT / "docs" / "results").glob("*.md"),
                *(ROOT / "docs" / "research").glob("*.md")}
QUOTING_PAGES = ["README.md", "docs/status.md"]

FIGURE = re.compile(r"(?<![\w.^/])~?\d[\d,]*(?:\.\d+)?(?:x\b|%|\s?(?:min|ms|s|h|MB|GB|GiB)\b)")
"""A measured figure: a number with a unit (a ratio, a share, a time, a size). ``x^3/16``, ``8x8``, ``fp16`` are not."""
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?[x%]?")
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]+)\)")
CITATION = re.compile(r"((?:docs/(?:results|research)/[\w.-]+\.md)|BENCHMARKS\.md)(?:,\s*'([^']+)')?")
_slug = slugify(case="lower")


def _prose(text: str) -> str:
    """Markdown without fenced code blocks, inline code and images (their numbers are code, not figures)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"!\[[^\]]*\]\([^)]*\)", "", text)


def _heading_text(heading: str) -> str:
    """A heading as the site renders it, for its anchor: link syntax, code marks and emphasis dropped."""
    heading = LINK.sub(lambda match: match.group(1), heading)
    return heading.replace("`", "").replace("*", "").strip()


def _sections(page: Path) -> list[tuple[str, str]]:
    """``[(heading text, its section's text up to the next heading of its level or above)]`` of a page."""
    lines, fenced, headings = page.read_text().splitlines(), False, []
    for index, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"(#+)\s+(.*)", line)
        if match:
            headings.append((index, len(match.group(1)), _heading_text(match.group(2))))
    sections = []
    for position, (start, level, title) in enumerate(headings):
        end = next((index for index, other, _ in headings[position + 1:] if other <= level), len(lines))
        sections.append((title, "\n".join(lines[start:end]).replace("*", "")))
    return sections


def _section(page: Path, anchor: str | None = None, title: str | None = None) -> str | None:
    """The text of ``page``'s section with this anchor or whose heading starts with ``title``; the page without
    either; ``None`` where no heading matches."""
    if anchor is None and title is None:
        return page.read_text().replace("*", "")
    for heading, text in _sections(page):
        if (anchor is not None and _slug(heading, "-") == anchor) or (
                title is not None and heading.lower().startswith(title.replace("`", "").lower())):
            return text
    return None


def _holds(section: str, token: str) -> bool:
    """Whether the number of ``token`` (``1.08x``, ``87.5%``, ``47.5``) is in ``section`` as a number, not a part of
    one (``0.98`` is not in ``0.981x``); the unit may differ (a table's ``77.5`` is the text's ``77.5%``)."""
    number = token.rstrip("x%")
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?!\d|[.,]\d)", section) is not None


def _markdown_problems(name: str) -> list[str]:
    page = ROOT / name
    prose, problems = _prose(page.read_text()), []
    for text, target in LINK.findall(prose):
        if not FIGURE.search(text):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if linked not in RESULT_PAGES:
            problems.append(f"{name}: [{text}] links {target}, not a results page")
            continue
        section = _section(linked, anchor or None)
        if section is None:
            problems.append(f"{name}: [{text}] links {target}: no such section")
            continue
        problems += [f"{name}: {token} of [{text}] is not in {target}"
                     for token in NUMBER.findall(text) if not _holds(section, token)]
    unlinked = LINK.sub("", prose)
    problems += [f"{name}: {match.group(0)!r} is not linked to its results page ('...{unlinked[max(0, match.start() - 60):match.end()]}')"
                 for match in FIGURE.finditer(unlinked)]
    return problems


def _help_texts() -> dict[str, str]:
    """``{where: text}`` of every ``--help``: the top level, each command's line, description and flags."""
    parser = _build_parser()
    texts = {"hf-knorm": f"{parser.description}\n{parser.epilog}"}
    for command in COMMANDS:
        texts[f"hf-knorm --help: {command.name}"] = command.help
        sub = parser.command_parsers[command.name]
        texts[f"hf-knorm {command.name}"] = sub.description
        for action in sub._actions:
            if action.help and action.help is not argparse.SUPPRESS:
                texts[f"hf-knorm {command.name} {action.option_strings[0] if action.option_strings else action.dest}"] = action.help
    return texts


def _help_problems(where: str, text: str) -> list[str]:
    figures = [match.group(0) for match in FIGURE.finditer(text)]
    if not figures:
        return []
    sections = []
    for path, title in CITATION.findall(text):
        section = _section(ROOT / path, title=title or None) if (ROOT / path).is_file() else None
        if section is None:
            return [f"{where}: cites {path}, {title!r}: no such page or section"]
        sections.append(section)
    if not sections:
        return [f"{where}: quotes {figures} without citing the results page that holds them"]
    return [f"{where}: {figure} is in none of the pages it cites" for figure in figures
            if not any(_holds(section, number) for section in sections for number in NUMBER.findall(figure))]


@pytest.mark.parametrize("name", QUOTING_PAGES)
def test_every_figure_the_page_quotes_links_the_results_section_that_holds_it(name):
    assert _markdown_problems(name) == []


def test_every_figure_a_help_text_quotes_is_on_the_results_page_it_cites():
    problems = [problem for where, text in _help_texts().items() for problem in _help_problems(where, text)]
    assert problems == []


def test_the_makefile_states_no_figure():
    """Its times are docs/status.md's ("Setup, times and status"), which links the measurements."""
    makefile = (ROOT / "Makefile").read_text()
    assert [match.group(0) for match in FIGURE.finditer(makefile)] == []
    assert "docs/status.md" in makefile


def test_the_check_catches_a_drifted_figure(tmp_path, monkeypatch):
    """The checks themselves, on a page quoting a figure that its results page no longer holds, a figure without a
    link, and a help text quoting a figure without its page."""
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "demo.md").write_text("# Demo\n\n## The main job\n\n**9 min 9 s** wall, 1.08x the original.\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "RESULT_PAGES", {results / "demo.md"})
    (tmp_path / "README.md").write_text(
        "A first run took [9 min 9 s](docs/results/demo.md#the-main-job), then [31 min](docs/results/demo.md); "
        "[1.08x](docs/results/demo.md#no-such-section); the callback costs 0.98x.\n")
    problems = _markdown_problems("README.md")
    assert len(problems) == 3, problems
    assert "31 of [31 min]" in problems[0] and "no such section" in problems[1] and "'0.98x'" in problems[2]
    assert _help_problems("convert", "the default: 1.24x at 1024 tokens") != []
    assert _help_problems("convert", "1.08x (docs/results/demo.md, 'The main job')") == []
    assert _help_problems("convert", "2.21x (docs/results/demo.md, 'The main job')") != []


GLOSSARY_TERMS = {
    "softmax window": "softmax-window", "sinks": "sinks", "window's mix": "window-mix", "paths": "paths",
    "K/V balancing": "kv-balancing", "KNorm": "knorm", "compression ratio": "compression-ratio",
    "eviction score": "eviction-score", "kvpress": "kvpress-protocol", "passkey": "needle-and-passkey",
    "attention transfer": "attention-transfer", "recovery": "recovery", "LoLCATs": "lolcats",
    "held-out domains": "held-out-domains", "beyond the window": "beyond-window-perplexity",
    "sparse cache": "sparse-cache", "prefix_kv_diff": "prefix_kv_diff", "clusters": "clusters",
    "codebook": "codebook", "pairs' bytes": "pairs-bytes",
}
"""The README's terms of the project: each one's first use links its entry of docs/glossary.md."""


def _readme_prose() -> str:
    """README.md without fenced code and headings (a heading names a section; the text under it uses the term)."""
    text = re.sub(r"^```.*?^```", lambda match: " " * len(match.group(0)), (ROOT / "README.md").read_text(),
                  flags=re.M | re.S)
    return re.sub(r"^#.*$", lambda match: " " * len(match.group(0)), text, flags=re.M)


def test_the_readme_links_the_first_use_of_each_term_to_the_glossary():
    prose = _readme_prose()
    glossary = {_slug(title, "-") for title, _ in _sections(ROOT / "docs" / "glossary.md")}
    links = [(match.span(1), match.group(2)) for match in LINK.finditer(prose)]
    for term, anchor in GLOSSARY_TERMS.items():
        assert anchor in glossary, f"docs/glossary.md has no entry #{anchor}"
        first = re.search(rf"(?<![\w/-]){re.escape(term)}(?![\w-])", prose, flags=re.I)
        assert first, f"the README does not use {term!r}: drop it from GLOSSARY_TERMS"
        inside = [target for (start, end), target in links if start <= first.start() < end]
        assert inside == [f"docs/glossary.md#{anchor}"], (term, prose[max(0, first.start() - 80):first.end() + 20])
    for target in re.findall(r"\(docs/glossary\.md#([^)]+)\)", prose):
        assert target in glossary, f"README.md links docs/glossary.md#{target}: no such entry"


def test_the_readme_is_short_and_its_quickstart_is_the_two_make_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 170
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", install, re.S)
                for line in block.splitlines() if line.startswith("make")]
    assert commands == ["make demo", "make test"]
    assert "two commands" in install
