"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``; not a page: ``exclude_docs``).

The guides are written to be read on GitHub too, where a link leaves ``docs/`` for a repository file
(``../BENCHMARKS.md#budget``). In the site:

- ``BENCHMARKS.md`` is the Results page (``results.md``, generated from it at build time, its own ``docs/...`` links
  made relative to ``docs/``);
- a link from a page to a repository file with a page in the site (``SITE_PAGES``) points at that page, its anchor
  kept (the site's heading ids are GitHub's: mkdocs.yml's ``toc.slugify``);
- any other link leaving ``docs/`` is left alone, and the strict build fails on it as on any broken link;
- Sphinx roles in docstrings (``:func:`patch```, ``:class:`~a.b.C```) render as the code they name (``C``).
"""

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]

# repository path -> the site page that stands for it (paths relative to docs/)
SITE_PAGES = {
    "BENCHMARKS.md": "results.md",
    "README.md": "index.md",  # the project's front page: the site's Home
    "model_cards/": "api/hub.md",  # the card template is rendered by save_pretrained / push_to_hub
}
RESULTS_SOURCE = "BENCHMARKS.md"

# an inline link or image target: ](target) or ](target "title")
_LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_ROLE = re.compile(r":(?:func|meth|class|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _outside_code(markdown: str, rewrite) -> str:
    """``rewrite`` applied to the text between fenced code blocks."""
    parts, last = [], 0
    for fence in _FENCE.finditer(markdown):
        parts += [rewrite(markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join(parts + [rewrite(markdown[last:])])


def _rewrite_links(markdown: str, page_dir: str, source_dir: str) -> str:
    """Targets in ``markdown`` (written relative to ``source_dir`` in the repository) made relative to the page's folder
    ``page_dir`` in docs/, through ``SITE_PAGES`` where they leave docs/."""

    def replace(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
            return match.group(0)  # a URL, an anchor on the same page, an absolute path
        path, _, anchor = target.partition("#")
        in_repo = posixpath.normpath(posixpath.join(source_dir, path)) + ("/" if path.endswith("/") else "")
        if in_repo.startswith("docs/"):
            new = posixpath.relpath(in_repo[len("docs/"):], page_dir or ".")
        elif in_repo in SITE_PAGES:
            new = posixpath.relpath(SITE_PAGES[in_repo], page_dir or ".")
        else:
            return match.group(0)  # left to the strict build to report
        return match.group(1) + new + ("#" + anchor if anchor else "") + match.group(3)

    return _outside_code(markdown, lambda text: _LINK.sub(replace, text))


def on_files(files, config):
    """The Results page: BENCHMARKS.md, generated into the site as results.md."""
    text = (ROOT / RESULTS_SOURCE).read_text()
    files.append(File.generated(config, SITE_PAGES[RESULTS_SOURCE], content=_rewrite_links(text, "", "")))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == SITE_PAGES[RESULTS_SOURCE]:
        return markdown  # rewritten in on_files
    page_dir = posixpath.dirname(page.file.src_uri)
    return _rewrite_links(markdown, page_dir, posixpath.join("docs", page_dir))


def on_page_content(html, page, config, files):
    return _ROLE.sub(lambda m: "<code>" + (m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)) + "</code>", html)
