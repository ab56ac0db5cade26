"""The repository explains itself: every committed results folder says how to make it again."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def test_every_results_folder_says_how_to_regenerate_it():
    folders = sorted(path for path in RESULTS.iterdir() if path.is_dir())
    assert len(folders) > 20  # the committed folders were found
    missing = [folder.name for folder in folders
               if not any(line.startswith(("Regenerate:", "- Regenerate:"))
                          for line in (folder / "README.md").read_text().splitlines())]
    assert not missing, f"results folders whose README has no 'Regenerate:' line: {missing}"
