"""The layout table of ``docs/layout.md`` holds: every module of the package imports
only what its row allows (the rules are stated above the table in that file).

The table is parsed, not copied here, so the document and the code cannot drift
apart: a new module without a row, an import its row does not allow, a row naming
a part that does not exist, pyzmq called outside ``_zmq_trio``, or trio / pyzmq in
a sans-IO part each fail one test below with the offending module and import.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zmqdispatch"
LAYOUT = ROOT / "docs" / "layout.md"

PKG = "zmqdispatch"
#: Importable from any module (the exception hierarchy and the limits).
ANYWHERE = (f"{PKG}.errors", f"{PKG}.limits")
#: Parts where pyzmq may be called, not only read for constants: the wrapper
#: itself, and the benchmarks, whose raw loop and engine measure pyzmq directly.
PYZMQ_CALLERS = (f"{PKG}._zmq_trio", f"{PKG}.bench")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _exists(name: str) -> bool:
    return name in MODULES


def _within(name: str, part: str) -> bool:
    """*name* is the module *part* or lies inside the package *part*. The package
    root only matches itself (it is not a part that contains everything)."""
    return name == part or (part != PKG and name.startswith(part + "."))


# ------------------------------------------------------------------ the table


class Row:
    def __init__(self, paths: list[str], allowed: set[str], everything: bool, sans_io: bool, line: str,
                 shell: bool = False):
        self.paths = paths
        self.allowed = allowed
        self.everything = everything
        self.sans_io = sans_io
        self.shell = shell
        self.line = line


def _paths(cell: str) -> list[str]:
    """Module names of a path cell: ``zmqdispatch/wire/`` -> ``zmqdispatch.wire``;
    ``zmqdispatch/errors.py``, ``limits.py`` -> both modules (a bare file name
    continues the directory of the first path)."""
    out: list[str] = []
    base = ""
    for tok in re.findall(r"`([^`]+)`", cell):
        if "/" not in tok:
            tok = base + tok
        base = tok.rsplit("/", 1)[0] + "/"
        name = tok.rstrip("/").removesuffix(".py").replace("/", ".")
        out.append(name.removesuffix(".__init__"))
    return out


def _parse_table() -> list[Row]:
    rows: list[Row] = []
    for line in LAYOUT.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith(f"`{PKG}"):
            continue
        paths = _paths(cells[0])
        may = cells[2]
        names = re.findall(r"`([^`]+)`", may)
        allowed = {n if n == PKG else f"{PKG}.{n}" for n in names}
        if "everything above" in may:
            for above in rows:
                allowed.update(above.paths)
        everything = bool(re.fullmatch(r"everything", may))
        rows.append(Row(paths, allowed, everything, cells[1].startswith("sans-IO"), line,
                        shell=cells[1].startswith("the trio shell")))
    return rows


ROWS = _parse_table()


def _row_of(module: str) -> Row | None:
    best: tuple[int, Row] | None = None
    for row in ROWS:
        for path in row.paths:
            if _within(module, path) and (best is None or len(path) > best[0]):
                best = (len(path), row)
    return None if best is None else best[1]


def _allowed(row: Row) -> tuple[bool, set[str]]:
    """(everything, the parts *row* may import, closed over the rows they belong to)."""
    allowed: set[str] = set(row.paths) | set(ANYWHERE)
    todo = list(row.allowed)
    while todo:
        part = todo.pop()
        if part in allowed:
            continue
        allowed.add(part)
        owner = _row_of(part)
        if owner is not None:
            if owner.everything:
                return True, allowed
            todo.extend(owner.allowed - allowed)
    return row.everything, allowed


# ------------------------------------------------------------------ imports


def _package_of(module: str, path: pathlib.Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _imports(module: str, path: pathlib.Path) -> tuple[set[str], set[str], ast.Module]:
    """(zmqdispatch modules imported, top-level third-party names imported, tree)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    ours: set[str] = set()
    others: set[str] = set()
    package = _package_of(module, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (ours if alias.name.split(".")[0] == PKG else others).add(
                    alias.name if alias.name.split(".")[0] == PKG else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PKG:
                others.add(target.split(".")[0])
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                ours.add(sub if _exists(sub) else target)
    return ours - {module}, others, tree


# ------------------------------------------------------------------ tests


def test_the_table_is_found_and_names_existing_parts():
    assert len(ROWS) >= 12, f"no layout table parsed from {LAYOUT}"
    for row in ROWS:
        for name in [*row.paths, *row.allowed]:
            assert _exists(name), f"{LAYOUT.name}: {name!r} is not a module or package of {PKG}\n  {row.line}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports_only_what_its_row_allows(module):
    row = _row_of(module)
    assert row is not None, f"{module} has no row in {LAYOUT.relative_to(ROOT)}"
    everything, allowed = _allowed(row)
    ours, _, _ = _imports(module, MODULES[module])
    if everything:
        return
    bad = sorted(t for t in ours if not any(_within(t, a) for a in allowed))
    assert not bad, (
        f"{module} imports {bad}, which its row of {LAYOUT.relative_to(ROOT)} does not allow:\n  {row.line}"
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_sans_io_parts_import_neither_trio_nor_pyzmq(module):
    row = _row_of(module)
    if row is None or not (row.sans_io or module in ANYWHERE):
        return
    _, others, _ = _imports(module, MODULES[module])
    assert not others & {"trio", "zmq"}, f"{module} is sans-IO but imports {sorted(others & {'trio', 'zmq'})}"


def _zmq_calls(tree: ast.Module) -> list[str]:
    """Uses of the ``zmq`` module other than reading an UPPER_CASE constant."""
    names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
             if a.name == "zmq"}
    froms = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "zmq"]
    bad = [f"from {n.module} import ..." for n in froms if not all(a.name.isupper() for a in n.names)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
            if not node.attr.isupper():
                bad.append(f"zmq.{node.attr} (line {node.lineno})")
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_wrapper_calls_pyzmq(module):
    if any(_within(module, p) for p in PYZMQ_CALLERS):
        return
    _, _, tree = _imports(module, MODULES[module])
    bad = _zmq_calls(tree)
    assert not bad, f"{module} calls pyzmq outside zmqdispatch/_zmq_trio.py: {bad}"


def test_the_trio_shell_is_named_in_the_table():
    shell = {p for row in ROWS if row.shell for p in row.paths}
    assert f"{PKG}.shell" in shell and f"{PKG}.client" in shell, shell


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_trio_shell_imports_no_pyzmq(module):
    row = _row_of(module)
    if row is None or not row.shell:
        return
    _, others, _ = _imports(module, MODULES[module])
    assert "zmq" not in others, f"{module} is the trio shell but imports pyzmq (use zmqdispatch._zmq_trio)"


#: The longest a module of the package may be (docs/layout.md).
MAX_MODULE_LINES = 800


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_the_line_limit(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines (at most {MAX_MODULE_LINES}: split it)"
