"""Every ```python block of docs/operations.md is a complete program that runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_the_document_has_snippets():
    assert len(SNIPPETS) == 4


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index):
    p = subprocess.run([sys.executable, "-c", SNIPPETS[index]], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
