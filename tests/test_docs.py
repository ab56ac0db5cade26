"""The repository explains itself, and its explanations cannot go stale silently: every ``docs/`` page
that the code cites exists, no citation names a design document outside the repository, every path a
``docs/`` page names exists, ``docs/benchmarks.md`` lists every script, and every committed results
folder says how to make it again."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = sorted([*(ROOT / "fitbench").rglob("*.py"), *(ROOT / "tests").glob("*.py"),
                  *(ROOT / "benchmarks").glob("*.py"), ROOT / "README.md", RESULTS / "README.md",
                  *(ROOT / "docs").glob("*.md")])
DOC_CITATION = re.compile(r"\bdocs/[\w./-]+\.md\b")
# A bare upper-case file name ending in .md is a page of no folder: one that lives outside the
# repository, which a reader of the repository cannot open. README.md is every folder's own.
BARE_DESIGN_DOC = re.compile(r"(?<![\w/.-])(?!README\.md)[A-Z][A-Z_]*\.md\b")
# Repository paths in backticks: a file of the package, the tests, the benchmarks or the docs.
REPO_PATH = re.compile(r"`((?:fitbench|tests|benchmarks|docs)/[\w./-]*|README\.md|\.gitignore)`")


def test_the_docs_pages_exist_and_the_readme_links_them():
    readme = (ROOT / "README.md").read_text()
    for name in ("architecture.md", "style.md", "results.md", "benchmarks.md", "planning.md",
                 "precisions.md", "parallelism.md", "running.md"):
        assert (ROOT / "docs" / name).is_file() and f"docs/{name}" in readme, name


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_cited_docs_page_exists_and_no_citation_leaves_the_repository(source):
    text = source.read_text()
    missing = sorted({cited for cited in DOC_CITATION.findall(text) if not (ROOT / cited).is_file()})
    assert not missing, f"{source.name} cites pages that do not exist: {missing}"
    outside = sorted(set(BARE_DESIGN_DOC.findall(text)))
    assert not outside, f"{source.name} cites documents that are not in the repository: {outside}"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda path: path.name)
def test_every_path_a_docs_page_names_exists(page):
    paths = sorted(set(REPO_PATH.findall(page.read_text())))
    if page.name == "architecture.md":
        assert len(paths) > 40  # the tables were read
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"docs/{page.name} names paths that do not exist: {missing}"


def test_the_benchmarks_page_lists_every_script():
    listed = set(REPO_PATH.findall((ROOT / "docs" / "benchmarks.md").read_text()))
    scripts = {str(path.relative_to(ROOT))
               for pattern in ("*.py", "*.sh") for path in (ROOT / "benchmarks").glob(pattern)}
    assert scripts and not scripts - listed, f"docs/benchmarks.md does not list {sorted(scripts - listed)}"


def test_every_name_the_architecture_page_gives_a_file_is_in_it():
    """``(`NAME`)`` after a module in the tables names something defined there: a renamed constant
    or function makes the page stale the same way a moved file does."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    checked = 0
    for line in text.splitlines():
        files = REPO_PATH.findall(line)
        names = re.findall(r"\(`([A-Za-z_][A-Za-z0-9_]*)`", line)
        names += [name for group in re.findall(r"\(`[A-Za-z_]+`(?:, `[A-Za-z_]+`)+\)", line)
                  for name in re.findall(r"`([A-Za-z_]+)`", group)]
        if not names or not files:
            continue
        sources = "".join((ROOT / path).read_text() for path in files if path.endswith(".py"))
        for name in set(names):
            assert re.search(rf"^\s*(?:def |class )?{name}\b", sources, flags=re.M), (name, files)
            checked += 1
    assert checked >= 10


def test_every_results_folder_says_how_to_regenerate_it():
    folders = sorted(path for path in RESULTS.iterdir() if path.is_dir())
    assert len(folders) > 20  # the committed folders were found
    missing = [folder.name for folder in folders
               if not any(line.startswith(("Regenerate:", "- Regenerate:"))
                          for line in (folder / "README.md").read_text().splitlines())]
    assert not missing, f"results folders whose README has no 'Regenerate:' line: {missing}"
