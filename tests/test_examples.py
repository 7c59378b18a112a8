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

def _control_plane(out: str) -> None:
    for line in ("engine: vLLM 0.32.0+zmqdispatch.mock (known)", "sleeping: True", "fully awake: True",
                 "paused: True", "running request ended with: ABORT", "prefix cache reset: True",
                 "workers healthy: [None]"):
        assert line in out, out
    assert "pause_generation: " in out and "0.33" in out
    assert "add_lora: " in out and "LoRA is not enabled" in out
    served = next(x for x in out.splitlines() if x.startswith("served after resume:"))
    assert len(served.split(":", 1)[1].strip("[] ").split(",")) == 4


#: What each example must print (a regex over its stdout, or a check), beyond exiting 0.
EXPECTED = {
    "generate.py": r"complete \[(\d+, ){7}\d+\]",
    "parallel_samples.py": r"(?m)(^[0-2] \[(\d+, ){5}\d+\] length\n){3}",
    "many_streams.py": r"100 requests, 1600 tokens",
    "tokenspeed.py": r"(?m)(^[01] \[(\d+, ){7}\d+\] length\n){2}",
    "control_plane.py": _control_plane,
}


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_as_written(path: Path) -> None:
    p = run([sys.executable, str(path)], ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert p.stdout.strip()
    expected = EXPECTED[path.name]
    if callable(expected):
        expected(p.stdout)
    else:
        assert re.search(expected, p.stdout), p.stdout


def test_every_example_has_its_expectation() -> None:
    assert sorted(EXPECTED) == sorted(p.name for p in EXAMPLES)


@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_snippet_runs_as_written(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"readme_{index}.py"
    script.write_text(README_BLOCKS[index])
    p = run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 0, f"README python block {index}:\n{README_BLOCKS[index]}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr
