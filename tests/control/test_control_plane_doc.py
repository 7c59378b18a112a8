"""The snippet of docs/control-plane.md runs against the mock engine (the example
script itself is run by tests/test_examples.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "control-plane.md"


def test_the_snippet_in_docs_control_plane_runs():
    doc = DOC.read_text()
    snippet = doc.split("```python\n", 1)[1].split("```", 1)[0]
    p = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["vLLM", "0.32.0+zmqdispatch.mock", "True", "True", "True"]
