"""The README's promises a first-time user acts on: its first two commands are the set-up ones, its quickstart
runs as pasted (in a fresh interpreter, an empty directory, nothing but the installed package) and stays short,
its tables stay readable and its relative links lead somewhere."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = "<!-- quickstart -->"
MAX_CODE_LINES = 16     # statements and code, comment-only lines not counted
MAX_LINE_CHARS = 120
MAX_TABLE_CELL = 200


def readme() -> str:
    return README.read_text(encoding="utf-8")


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(offset of the opening fence, language, body) of every ``` block, in order."""
    return [(m.start(), m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def quickstart(text: str) -> str:
    """The one fenced python block right after the marker comment."""
    assert text.count(MARKER) == 1, f"README.md must hold exactly one {MARKER!r}, found {text.count(MARKER)}"
    after = text.index(MARKER) + len(MARKER)
    block = next((b for b in fenced_blocks(text) if b[0] > after), None)
    assert block is not None, f"no fenced code block after {MARKER!r}"
    start, lang, body = block
    assert text[after:start].strip() == "", f"{MARKER!r} must sit right before the quickstart's fence"
    assert lang == "python", f"the quickstart block is {lang!r}, expected 'python'"
    return body


def code_lines(source: str) -> list[str]:
    return [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_first_two_commands_are_the_setup_ones():
    """What a fresh machine runs first: the demo and the tests, each setting itself up; nothing comes before them
    but the title."""
    text = readme()
    start, lang, body = fenced_blocks(text)[0]
    assert text[:start].strip() == "# cachedemb", f"only the title may precede the set-up commands: {text[:start]!r}"
    assert lang == "bash"
    commands = [line.split("#")[0].strip() for line in body.splitlines() if line.strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"], commands
    for script in ("demo.sh", "test.sh", "setup_env.sh"):
        assert (ROOT / "scripts" / script).is_file(), script
    for script in ("demo.sh", "test.sh"):   # each one sets itself up on a fresh machine
        assert "scripts/setup_env.sh" in (ROOT / "scripts" / script).read_text(), script


def test_quickstart_is_short():
    source = quickstart(readme())
    lines = code_lines(source)
    assert 0 < len(lines) <= MAX_CODE_LINES, f"the quickstart has {len(lines)} code lines (at most {MAX_CODE_LINES})"
    long = [line for line in source.splitlines() if len(line) > MAX_LINE_CHARS]
    assert not long, f"quickstart lines over {MAX_LINE_CHARS} characters: {long}"
    compile(source, "README quickstart", "exec")   # a syntax error fails here, before the slow run


def test_quickstart_runs_as_pasted(tmp_path):
    """Run the block as a user would paste it: a new interpreter, an empty working directory (so only the
    installed package is importable, not the checkout), CPU only. It must train (the loss falls), report the
    cache and write its checkpoint."""
    source = quickstart(readme())
    for name in ("CachedEmbeddingBag", "cachedemb.prefetch(", "ids=", "cachedemb.optim.", "cache_stats()",
                 "save_checkpoint", "load_checkpoint"):
        assert name in source, f"the quickstart no longer shows {name!r}"
    script = tmp_path / "quickstart.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CACHEDEMB_BACKEND")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""   # the laptop case; the test suite never needs a GPU
    # A few seconds of CPU; the limit leaves room for a box shared by other jobs (importing torch alone took 15 s
    # at a load of ~10 on 2 cores).
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"quickstart exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss (\d+\.\d+)$", done.stdout, re.M)]
    assert len(losses) >= 3, f"expected the loss printed every few steps:\n{done.stdout}"
    assert losses[-1] < losses[0] - 0.05, f"the loss did not fall: {losses}"
    found = re.search(r"hit rate (\d\.\d\d), (\d+) rows moved in for (\d+) lookups", done.stdout)
    assert found, f"expected the cache's hit rate and rows moved:\n{done.stdout}"
    hit_rate, rows_in, lookups = float(found.group(1)), int(found.group(2)), int(found.group(3))
    assert 0.0 <= hit_rate <= 1.0 and 0 < rows_in <= lookups, found.group(0)
    assert (tmp_path / "ckpt.pt").is_file(), "the quickstart's checkpoint was not written"


def test_readme_tables_are_readable():
    long = []
    for number, line in enumerate(readme().splitlines(), 1):
        if line.startswith("|"):
            long += [(number, len(cell.strip())) for cell in line.strip().strip("|").split("|")
                     if len(cell.strip()) > MAX_TABLE_CELL]
    assert not long, f"README table cells over {MAX_TABLE_CELL} characters (line, length): {long}"


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md", "docs/install.md", "docs/distributed.md",
                                 "benchmarks/results/README.md"])
def test_relative_links_resolve(doc):
    """The README sends readers to docs/ for everything it no longer says: each such link must lead to a file,
    and a #fragment to a heading there (GitHub's anchor rule: lower case, punctuation dropped, spaces to -)."""
    path = ROOT / doc
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
            continue
        if fragment and dest.suffix == ".md":
            anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                       for h in re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), re.M)}
            if fragment not in anchors:
                broken.append(target)
    assert not broken, f"{doc}: links that lead nowhere: {broken}"
