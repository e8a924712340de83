"""The documentation site builds without warnings and reads well in a real browser.

The browser test serves the built site on localhost and opens the home page, the first
chapter, the limitations page and the API reference in Debian's headless Chromium
(/usr/bin/chromium), driven by Playwright, which never downloads a browser of its own. It
checks that the math is typeset by the vendored KaTeX, that every image loads, that nothing is
fetched from another host and that the console stays free of errors; that the home page shows
the tables generated from the saved results and links the limitations page; and that the API
reference's examples render as code. With SAVE_SCREENSHOTS=1 it also saves
docs/screenshots/landing.png, chapter.png, limitations.png and api.png.

A chapter is shown from its executed copy docs/executed/NN_name.ipynb when there is one (with
the outputs of a GPU run), else from notebooks/NN_name.py; either way its page links the .py.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import jupytext
import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHAPTERS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py"))
EXECUTED = REPO / "docs" / "executed"
# A tag that loads something from another host: http://, https:// or protocol-relative //.
REMOTE_LOAD = re.compile(
    r"<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=\"(?:https?:)?//"
)


def build_site(site_dir: Path, **env: str) -> Path:
    """`mkdocs build --strict` into `site_dir` (any warning fails the build)."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    return site_dir


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as the repository builds it."""
    return build_site(tmp_path_factory.mktemp("site"))


def test_site_builds_with_every_chapter(site: Path) -> None:
    for page in ["index.html", "install/index.html", "limitations/index.html", "api/index.html"]:
        assert (site / page).is_file(), page
    for notebook in CHAPTERS:
        assert (site / "notebooks" / notebook.stem / "index.html").is_file(), notebook.name


# A line that Markdown reads as the start of a block (a list item, a quote, a heading).
BLOCK_START = re.compile(r"\s*([-+*>]\s|#|\d+[.)]\s)")


def lines_starting_a_block_inside_math(markdown: str) -> list[str]:
    """Lines of `markdown` that begin with a block marker while an inline `$...$` is open:
    Markdown ends the paragraph there, and the math never renders (a wrapped `- m'}$`)."""
    found, inline, display = [], False, False
    for line in re.sub(r"`[^`]*`", "``", markdown).split("\n"):
        if not line.strip():
            inline = False  # a blank line ends the paragraph, and any math in it
            continue
        if inline and not display and BLOCK_START.match(line):
            found.append(line)
        for token in re.findall(r"\\.|\$\$|\$", line):
            if token == "$$":
                display = not display
            elif token == "$" and not display:
                inline = not inline
    return found


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_inline_math_never_wraps_onto_a_block_marker(chapter: Path) -> None:
    cells = [c.source for c in jupytext.read(chapter).cells if c.cell_type == "markdown"]
    broken = [line for cell in cells for line in lines_starting_a_block_inside_math(cell)]
    assert not broken, f"{chapter.name}: rewrap these lines, which break their math: {broken}"


def test_every_chapter_page_links_its_source(site: Path) -> None:
    for notebook in CHAPTERS:
        stem = notebook.stem
        page = (site / "notebooks" / stem / "index.html").read_text()
        assert 'class="admonition info chapter-source"' in page, f"{stem}: no source note"
        assert f'href="{stem}.py"' in page, f"{stem}: no link to its source"
        assert (site / "notebooks" / stem / f"{stem}.py").read_text() == notebook.read_text()
        if (EXECUTED / f"{stem}.ipynb").is_file():
            assert f'href="{stem}.ipynb"' in page, f"{stem}: no link to its executed notebook"
            assert (site / "notebooks" / stem / f"{stem}.ipynb").is_file()
        else:
            assert "not yet executed for the site" in page, f"{stem}: says nothing of outputs"


def test_executed_copy_replaces_the_chapter(tmp_path: Path) -> None:
    """With docs/executed/NN_name.ipynb, the chapter shows that notebook and its outputs."""
    if not CHAPTERS:
        pytest.skip("skipped: notebooks/ has no chapter yet")
    chapter, marker = CHAPTERS[0], "an output from the executed copy"
    notebook = jupytext.read(chapter)
    code = next(cell for cell in notebook.cells if cell.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text=marker + "\n")]
    code.execution_count = 1
    notebook.metadata["jvp_attention"] = {
        "source": f"notebooks/{chapter.name}",
        "seconds": 12.3,
        "device": "Test GPU 9000",
        "date": "2000-01-02",
    }
    executed = tmp_path / "executed"
    executed.mkdir()
    jupytext.write(notebook, executed / f"{chapter.stem}.ipynb")
    site = build_site(tmp_path / "site", JVP_ATTENTION_EXECUTED=str(executed))

    folder = site / "notebooks" / chapter.stem
    page = (folder / "index.html").read_text()
    assert marker in page, "the chapter page does not show the executed notebook's output"
    assert "on Test GPU 9000" in page and "2000-01-02" in page, "no provenance of the outputs"
    assert (folder / f"{chapter.stem}.py").read_text() == chapter.read_text()
    shown = json.loads((folder / f"{chapter.stem}.ipynb").read_text())
    assert shown["metadata"]["jvp_attention"]["device"] == "Test GPU 9000"
    home = (site / "index.html").read_text()
    links = [home.find(f'href="notebooks/{notebook.stem}/"') for notebook in CHAPTERS]
    assert -1 not in links and links == sorted(links), "the chapters left their reading order"
    title = jupytext.read(chapter).cells[0].source.splitlines()[0].removeprefix("# ")
    assert f"<title>{title}" in page.replace("&amp;", "&"), "the chapter lost its title"
    for other in CHAPTERS[1:]:
        assert (
            "not yet executed for the site"
            in (site / "notebooks" / other.stem / "index.html").read_text()
        ), f"{other.stem} is not shown from its source"


def test_site_loads_nothing_from_other_hosts(site: Path) -> None:
    offenders = [
        f"{page.relative_to(site)}: {match.group(0)}"
        for page in site.rglob("*.html")
        for match in REMOTE_LOAD.finditer(page.read_text())
    ]
    assert not offenders, "the site must work offline:\n" + "\n".join(offenders)


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    """Serve the built site on an ephemeral localhost port; yields its base URL."""

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    handler = functools.partial(QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A headless Chromium (Debian's) with a fresh profile, driven by Playwright."""
    if not CHROMIUM.exists():
        pytest.skip("skipped: needs Chromium at /usr/bin/chromium (apt-get install chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="skipped: needs the playwright package (pip install playwright)",
    )
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        yield context
        context.close()


SCREENSHOT_MAX_PX = 3000

# Text that a reader sees, without code, scripts and the typeset math itself.
PROSE_TEXT = """() => {
    const body = document.body.cloneNode(true);
    body.querySelectorAll("pre, code, script, style, .katex").forEach((e) => e.remove());
    return body.textContent;
}"""

IMAGES = """() => Array.from(document.images).map(
    (image) => ({src: image.src, ok: image.complete && image.naturalWidth > 0}))"""


def check_page(context: object, url: str, screenshot: str, math: bool = True) -> object:
    """Open `url` and check math (on a page that has some), images, requests and console;
    maybe save a screenshot. Returns the open page; the caller closes it."""
    page = context.new_page()  # type: ignore[attr-defined]
    problems: list[str] = []
    page.on(
        "console",
        lambda message: message.type == "error" and problems.append(f"console: {message.text}"),
    )
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("requestfailed", lambda request: problems.append(f"failed to load {request.url}"))

    def only_localhost(route: object) -> None:
        request_url = route.request.url  # type: ignore[attr-defined]
        if urlsplit(request_url).hostname in {"127.0.0.1", "localhost"}:
            route.continue_()  # type: ignore[attr-defined]
        else:
            problems.append(f"request to another host: {request_url}")
            route.abort()  # type: ignore[attr-defined]

    page.route("**/*", only_localhost)
    page.goto(url, wait_until="load")
    if math:
        page.wait_for_function("document.querySelectorAll('.katex').length > 0", timeout=15_000)
    page.evaluate("document.fonts.ready.then(() => true)")
    page.wait_for_load_state("networkidle")

    prose = page.evaluate(PROSE_TEXT)
    for raw in ["$$", "\\[", "\\("]:
        assert raw not in prose, f"{url}: untypeset math ({raw!r}) left in the text"
    errors = page.locator(".katex-error").all_inner_texts()
    assert not errors, f"{url}: KaTeX could not typeset {errors}"
    broken = [image["src"] for image in page.evaluate(IMAGES) if not image["ok"]]
    assert not broken, f"{url}: images that did not load: {broken}"
    assert not problems, f"{url}:\n" + "\n".join(problems)

    if os.environ.get("SAVE_SCREENSHOTS") == "1":
        target = REPO / "docs" / "screenshots" / screenshot
        target.parent.mkdir(parents=True, exist_ok=True)
        height = min(page.evaluate("document.documentElement.scrollHeight"), SCREENSHOT_MAX_PX)
        # A viewport as tall as the shot, rather than a full-page capture, which scrolls and
        # makes the theme start hiding its navigation tabs.
        page.set_viewport_size({"width": 1280, "height": height})
        page.wait_for_timeout(1_000)  # the theme's transitions
        page.screenshot(path=str(target))
    return page


# The header cells of each table in the page's content.
TABLE_HEADERS = """() => Array.from(document.querySelectorAll("article table")).map(
    (table) => Array.from(table.querySelectorAll("th")).map((th) => th.textContent.trim()))"""


def test_landing_page_in_browser(server: str, browser_context: object) -> None:
    page = check_page(browser_context, f"{server}/", "landing.png")
    headers = page.evaluate(TABLE_HEADERS)
    assert any("forward + JVP, TFLOP/s" in row for row in headers), (
        f"the home page has no generated benchmark table: {headers}")
    content = page.locator("article").inner_text()
    if (REPO / "examples" / "results" / "bench_dit_b2_h200.json").is_file():
        assert any(any(h.startswith("PyTorch math") for h in row) for row in headers), (
            f"the home page has no generated training-step table: {headers}")
    else:  # chapter 9's DiT-B/2 run is not saved yet: the page says so
        assert "has not been measured yet" in content
    assert "table:" not in content, "a table marker was left unfilled"
    assert "x less memory" in content
    link = page.locator('article a[href="limitations/"]')
    assert link.count() > 0, "the home page does not link the limitations page"
    link.first.click()
    page.wait_for_load_state("load")
    assert page.url.rstrip("/").endswith("/limitations"), page.url
    assert page.locator("h1").first.inner_text().strip().startswith("Support and limitations")
    page.close()


def test_chapter_in_browser(server: str, browser_context: object) -> None:
    if not CHAPTERS:
        pytest.skip("skipped: notebooks/ has no chapter yet")
    check_page(browser_context, f"{server}/notebooks/{CHAPTERS[0].stem}/", "chapter.png").close()


def test_limitations_page_in_browser(server: str, browser_context: object) -> None:
    page = check_page(browser_context, f"{server}/limitations/", "limitations.png", math=False)
    headings = page.locator("article h2").all_inner_texts()
    for expected in ["GPUs and versions", "What it accepts", "Transforms and derivatives",
                     "On a CPU", "Precision modes and their cost", "The sdpa() drop-in"]:
        assert any(expected in heading for heading in headings), f"no section {expected!r}"
    headers = page.evaluate(TABLE_HEADERS)
    assert ["shape", "forward + JVP", "backward", "backward through output and tangent"] in [
        [h.strip() for h in row] for row in headers], f"no generated precision table: {headers}"
    nav = page.locator("nav a", has_text="Support and limitations")
    assert nav.count() > 0, "the limitations page is not in the navigation"
    page.close()


# Code blocks of the rendered docstrings, outside the collapsed "Source code" listings.
DOCSTRING_CODE = """() => Array.from(document.querySelectorAll(".doc-contents .highlight pre > code"))
    .filter((code) => !code.closest("details.mkdocstrings-source"))
    .map((code) => code.textContent)"""


def test_api_page_in_browser(server: str, browser_context: object) -> None:
    page = check_page(browser_context, f"{server}/api/", "api.png", math=False)
    examples = page.evaluate(DOCSTRING_CODE)
    assert any(">>>" in code and "torch.func.jvp" in code for code in examples), (
        f"the docstrings' examples do not render as code blocks: {examples}")
    assert any("with sdpa() as routing:" in code for code in examples), examples
    quoted = page.locator(".doc-contents blockquote").all_inner_texts()
    assert not quoted, f"docstring text rendered as blockquotes: {quoted}"
    ids = page.evaluate("""() => Array.from(document.querySelectorAll(".doc-heading"))
        .map((heading) => heading.id)""")
    for name in ["jvp_attention.attention", "jvp_attention.attention_jvp", "jvp_attention.sdpa",
                 "jvp_attention.set_precision", "jvp_attention.autograd.SDPARouting",
                 "jvp_attention.autograd.Unsupported"]:
        assert name in ids, f"{name} is not documented: {ids}"
    internal = [i for i in ids if i.startswith(("jvp_attention.forward.",
                                                "jvp_attention.backward."))]
    assert not internal, f"internal helpers on the API page: {internal}"
    returns = page.evaluate("""() => {
        const heading = document.getElementById("jvp_attention.attention");
        const title = Array.from(heading.parentElement.querySelectorAll(".doc-section-title"))
            .find((span) => span.textContent.trim() === "Returns:");
        // the theme wraps each table in scrolling <div>s
        const next = title && title.closest("p").nextElementSibling;
        const table = next && (next.tagName === "TABLE" ? next : next.querySelector("table"));
        return table ? table.querySelectorAll("tbody tr").length : -1;
    }""")
    assert returns == 1, f"attention's Returns shows {returns} values, not one"
    page.close()
