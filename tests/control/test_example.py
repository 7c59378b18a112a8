"""examples/control_plane.py runs against the mock engine and says what it did."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "control_plane.py"


def test_control_plane_example_runs_against_the_mock():
    p = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for line in ("engine: vLLM 0.32.0+zmqdispatch.mock (known)", "sleeping: True", "fully awake: True",
                 "paused: True", "running request ended with: ABORT", "prefix cache reset: True",
                 "workers healthy: [None]"):
        assert line in out, out
    assert "pause_generation: " in out and "0.33" in out
    assert "add_lora: " in out and "LoRA is not enabled" in out
    served = next(x for x in out.splitlines() if x.startswith("served after resume:"))
    assert len(served.split(":", 1)[1].strip("[] ").split(",")) == 4


def test_the_snippet_in_docs_control_plane_runs():
    doc = (EXAMPLE.parents[1] / "docs" / "control-plane.md").read_text()
    snippet = doc.split("```python\n", 1)[1].split("```", 1)[0]
    p = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["vLLM", "0.32.0+zmqdispatch.mock", "True", "True", "True"]
