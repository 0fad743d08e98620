"""The docs site and the README: every Python block runs, the site builds, the README stays short.

A page's ``python`` blocks are run in order on 2 gloo ranks, in a fresh directory, as torchrun
runs a script (each rank runs it as ``__main__`` and joins the process group through
torchrun's environment), but in ranks forked with torch already imported. A block that calls
``init_process_group`` starts a new script, run by new ranks, as a user would launch it; the
blocks after it, up to the next such block, go on in that script. (One process that joins
twice through torchrun's store can read the first group's stale addresses and hang: torch
resets its group names on ``destroy_process_group``.) A page that says
``<!-- docs-test: verbatim FILE -->`` shows parts of FILE instead: ``tests/app/test_examples.py``
checks its blocks are in FILE word for word and runs FILE. Blocks in any
other language are output or shell: ``text`` and ``bash`` only, and every ``python -m
flatshard`` line of a ``bash`` block must parse with the CLI's own parser.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flatshard.app.cli import build_parser
from flatshard.toolkit.testing import RankError, run_script

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
VERBATIM = re.compile(r"<!-- docs-test: verbatim (\S+) -->")
README_LINES = 250


def _blocks(page: Path) -> list[tuple[str, str]]:
    return FENCE.findall(page.read_text())


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


EXAMPLE_PAGES = {  # (what test_examples checks)
    "docs/finetune.md": "examples/finetune_lora.py",
    "docs/lightning.md": "examples/lightning_trainer.py",
}
RUNNABLE = [
    p for p in PAGES if any(lang == "python" for lang, _ in _blocks(p)) and not VERBATIM.search(p.read_text())
]


def test_pages_of_example_code_are_the_ones_test_examples_checks():
    marked = {_name(p): m.group(1) for p in PAGES if (m := VERBATIM.search(p.read_text()))}
    assert marked == EXAMPLE_PAGES


def _scripts(page: Path) -> list[str]:
    """The page's ``python`` blocks as the scripts a user would launch, in order."""
    scripts: list[list[str]] = []
    for lang, body in _blocks(page):
        if lang == "python":
            if not scripts or "init_process_group(" in body:
                scripts.append([])
            scripts[-1].append(body)
    return ["\n\n".join(blocks) for blocks in scripts]


def test_a_page_splits_into_scripts_where_a_block_joins_the_group():
    assert len(_scripts(ROOT / "docs/checkpoints.md")) == 2  # (two whole scripts, each joins once)
    assert len(_scripts(ROOT / "docs/optimizers.md")) == 1  # (one script, then blocks that go on)


@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_the_python_blocks_of_each_page_run(page, tmp_path):
    for i, code in enumerate(_scripts(page)):
        script = tmp_path / f"page{i}.py"
        script.write_text(code)
        try:
            # (aot_eager: the pages show compile paths; [Note: compile backends in the suite])
            run_script(script, 2, cwd=tmp_path, timeout=420, compile_backend="aot_eager")
        except RankError as e:
            pytest.fail(f"{_name(page)}'s script {i} failed on rank {e.rank}:\n{e.trace[-6000:]}")


def test_every_block_says_its_language():
    for page in PAGES:
        for lang, body in _blocks(page):
            assert lang in ("python", "text", "bash"), (_name(page), lang, body[:200])


def test_the_cli_lines_of_bash_blocks_parse():
    parser = build_parser()
    lines = [
        line.split("#")[0].strip()
        for page in PAGES
        for lang, body in _blocks(page)
        if lang == "bash"
        for line in body.splitlines()
    ]
    commands = [line for line in lines if line.startswith("python -m flatshard")]
    assert commands, "no CLI line found: the pattern is wrong"
    for line in commands:
        parser.parse_args(shlex.split(line)[3:])  # (argparse exits on a bad option)


def test_the_readme_is_a_short_product_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES
    assert not re.search(r"\bissue \d+", text, re.I), "no issue numbers in the README"
    assert "../" not in text, "no links outside the repository"


def test_the_docs_site_builds_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()
