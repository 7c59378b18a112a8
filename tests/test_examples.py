"""Every script in ``examples/`` and every ``python`` block of the README runs
as written (each launches the mock engine when no address is given)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
README_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)

#: What each example must print (a regex over its stdout), beyond exiting 0.
EXPECTED = {
    "generate.py": r"complete \[(\d+, ){7}\d+\]",
    "parallel_samples.py": r"(?m)(^[0-2] \[(\d+, ){5}\d+\] length\n){3}",
    "many_streams.py": r"100 requests, 1600 tokens",
    "tokenspeed.py": r"(?m)(^[01] \[(\d+, ){7}\d+\] length\n){2}",
}


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_as_written(path: Path) -> None:
    p = run([sys.executable, str(path)], ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert p.stdout.strip()
    if path.name in EXPECTED:
        assert re.search(EXPECTED[path.name], p.stdout), p.stdout


def test_every_example_has_its_expectation() -> None:
    assert sorted(EXPECTED) == sorted(p.name for p in EXAMPLES if p.name in EXPECTED)


@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_snippet_runs_as_written(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"readme_{index}.py"
    script.write_text(README_BLOCKS[index])
    p = run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 0, f"README python block {index}:\n{README_BLOCKS[index]}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr
