"""The repository stands alone: it cites only its own documents, and they exist.

- No text file of the package, scripts, tests, fuzz harnesses, benchmarks, protos or
  docs names a document outside the repository (the development workplace's
  ``shared/`` folder or one of its reference files). Facts the code relies on live
  in ``docs/`` instead.
- Every ``docs/<name>.md`` cited anywhere in those files or in the README exists, and
  a reference that follows the citation exists in it as a heading: ``§5.8`` (a
  numbered section), ``K7`` (``docs/known-failures.md``), ``lesson 11b``
  (``docs/reference-gateway-lessons.md``), ``rule 4`` (``docs/trio-and-zmq.md``).
- Relative links inside ``docs/`` point at files that exist.

One exemption: ``tests/wire/test_vllm_golden.py`` checks, inside the development
workplace only (it skips elsewhere), that ``tests/wire/vectors/vllm_0.32.0.json`` is an
exact copy of the workplace's vector set, so it names ``../shared/vectors``.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("zmqdispatch", "scripts", "tests", "fuzz", "benchmarks", "protos", "docs")
SKIP_DIRS = {"__pycache__", ".hypothesis", ".pytest_cache"}
THIS = pathlib.Path(__file__).resolve()

#: Names of documents that are not in the repository (the workplace's reference set).
FOREIGN = (
    "shared/spec",
    "../shared",
    "vllm_wire.md",
    "vllm_wire_capture",
    "vllm_headless.md",
    "tokenspeed_wire.md",
    "reference_gateway.md",
    "trio_zmq.md",
    "known_failures.md",
    "style.md",
)
#: (file relative to the root, the one foreign name it may use, why).
EXEMPT = {
    ("tests/wire/test_vllm_golden.py", "../shared"): "compares the vectors copy with the workplace's, skips elsewhere",
}
#: Documents cited on ``main`` that another branch is writing: tolerated while absent
#: only (once the file exists, its citations are checked like any other).
NOT_YET_WRITTEN = {
    "deployment": "engine launch and Linux scheduling autogroups (cited by zmqdispatch/client.py)",
}


def _text_files() -> list[pathlib.Path]:
    out = []
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*")):
            if not p.is_file() or SKIP_DIRS & set(p.relative_to(ROOT).parts) or p.resolve() == THIS:
                continue
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary (plots, ...)
            if "\x00" not in text:
                out.append(p)
    return out


FILES = _text_files()


def _rel(p: pathlib.Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_the_scan_sees_the_code():
    names = {_rel(p) for p in FILES}
    assert "zmqdispatch/client.py" in names and "docs/vllm-wire.md" in names
    assert len(names) > 100


def test_no_file_names_a_document_outside_the_repository():
    hits = []
    for p in FILES:
        for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            for name in FOREIGN:
                if name in line and (_rel(p), name) not in EXEMPT:
                    hits.append(f"{_rel(p)}:{lineno}: {name!r}: {line.strip()[:100]}")
    assert not hits, "cite docs/ instead:\n" + "\n".join(hits)


def test_the_exemptions_are_still_needed():
    for (rel, name), why in EXEMPT.items():
        assert name in (ROOT / rel).read_text(encoding="utf-8"), f"drop the exemption of {rel} ({why})"


# ---------------------------------------------------------------- citations

_CITE = re.compile(r"docs/([A-Za-z0-9_-]+)\.md")
# What may follow a citation: separators and references, nothing else.
_TAIL = re.compile(
    r"(?:[\s`'\"#*:,;()]|and\b|§\d+(?:\.\d+)*|-§?\d+(?:\.\d+)*|\bK\d+[a-z]?\b|lesson \d+[a-z]?\b|rule \d+\b)*"
)
_REF = re.compile(r"§(\d+(?:\.\d+)*)|-(\d+(?:\.\d+)*)|\bK(\d+)[a-z]?\b|lesson (\d+[a-z]?)\b|rule (\d+)\b")


def _citations() -> list[tuple[str, str, list[str]]]:
    """(where, cited doc name, the references right after the citation)."""
    out = []
    for p in [*FILES, ROOT / "README.md"]:
        text = p.read_text(encoding="utf-8")
        for m in _CITE.finditer(text):
            tail = _TAIL.match(text, m.end()).group(0)
            refs = []
            for r in _REF.finditer(tail):
                sec, rng, k, lesson, rule = r.groups()
                if sec or rng:
                    refs.append("§" + (sec or rng))
                elif k:
                    refs.append("K" + k)
                elif lesson:
                    refs.append("lesson " + lesson)
                else:
                    refs.append("rule " + rule)
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{_rel(p)}:{line}", m.group(1), refs))
        if "docs/known-failures.md" in text:
            # A file that cites the list tags its replays with ``# K7`` comments.
            for m in re.finditer(r"#\s*K(\d+)[a-z]?\b", text):
                line = text.count("\n", 0, m.start()) + 1
                out.append((f"{_rel(p)}:{line}", "known-failures", ["K" + m.group(1)]))
    return out


CITATIONS = _citations()


def _has(doc: str, ref: str) -> bool:
    if ref.startswith("§"):
        num = re.escape(ref[1:])
        pattern = rf"^#{{2,6}} {num}[. ]" if "." in ref else rf"^## {num}\. "
    elif ref.startswith("K"):
        pattern = rf"^## {ref}\. "
    elif ref.startswith("lesson "):
        pattern = rf"^### Lesson {re.escape(ref.split()[1])}\. "
    else:
        pattern = rf"^{ref.split()[1]}\. \*\*"
    return re.search(pattern, doc, re.MULTILINE) is not None


def test_sources_cite_the_docs():
    # The point of this file: the code does cite docs/, so the check below is not vacuous.
    cited = {name for _, name, _ in CITATIONS}
    assert {"vllm-wire", "tokenspeed-wire", "trio-and-zmq", "known-failures"} <= cited
    assert sum(len(refs) for _, _, refs in CITATIONS) > 40


def test_every_cited_document_and_section_exists():
    missing = []
    for where, name, refs in CITATIONS:
        path = ROOT / "docs" / f"{name}.md"
        if not path.exists():
            if name in NOT_YET_WRITTEN:
                continue
            missing.append(f"{where}: docs/{name}.md does not exist")
            continue
        doc = path.read_text(encoding="utf-8")
        missing += [f"{where}: docs/{name}.md has no {ref}" for ref in refs if not _has(doc, ref)]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_relative_links_in_docs_exist(doc):
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        if not (doc.parent / target).exists():
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"
