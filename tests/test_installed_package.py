"""The installed package stands alone: nothing in ``zmqdispatch/`` depends on files
that only exist in a source checkout (``scripts/``, ``benchmarks/``, ``tests/``,
``protos/``, ``examples/``, ``fuzz/``, ``docs/``).

Two checks: the package's code never builds a path out of its own directory or
into those folders (read with ``ast``: docstrings, comments and messages that
*name* them are fine), and a copy of exactly what a wheel installs (the
``zmqdispatch*`` packages' ``.py`` files and the package data ``pyproject.toml``
declares), run from a directory that is not a checkout, generates against the mock
engine, answers ``bench --help``, and says what to pass when the real-vLLM helper
scripts are missing.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zmqdispatch"
CHECKOUT_ONLY = {"scripts", "benchmarks", "tests", "protos", "examples", "fuzz", "docs"}


def _file_names(tree: ast.Module) -> set[str]:
    """``__file__`` and the names assigned from an expression built on it
    (``HERE = Path(__file__).resolve().parent``), to a fixed point."""
    names = {"__file__"}
    while True:
        more = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _uses(n.value, names)
                for t in n.targets if isinstance(t, ast.Name)} - names
        if not more:
            return names
        names |= more


def _uses(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def _escapes(tree: ast.Module) -> list[tuple[int, str]]:
    """Path expressions of *tree* that leave the package or enter a checkout-only folder."""
    found: list[tuple[int, str]] = []
    file_names = _file_names(tree)

    def _is_file_expr(node: ast.AST) -> bool:
        return _uses(node, file_names)

    for node in ast.walk(tree):
        # Path(__file__).parents[k]: more than one level up from a module of the
        # package is outside it (its own package directory is parents[0]).
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parents" and _is_file_expr(node.value):
            found.append((getattr(node, "lineno", 0), ast.unparse(node)))
        # Path(__file__).parent.parent (.parent once is the module's own directory)
        if isinstance(node, ast.Attribute) and node.attr == "parent" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parent" and _is_file_expr(node.value):
            found.append((getattr(node, "lineno", 0), ast.unparse(node)))
        # os.path.dirname(os.path.dirname(__file__)) and deeper
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("dirname") and node.args \
                and isinstance(node.args[0], ast.Call) and ast.unparse(node.args[0].func).endswith("dirname") \
                and _is_file_expr(node.args[0]):
            found.append((getattr(node, "lineno", 0), ast.unparse(node)))
        # a path segment naming a checkout-only folder, joined to something:
        # x / "scripts", os.path.join(x, "tests", ...), Path("benchmarks/..."), "../protos"
        parts: list[ast.AST] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [node.left, node.right]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.path.join", "Path", "pathlib.Path"):
            parts = list(node.args)
        for part in parts:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                first = part.value.strip("./").split("/")[0]
                if first in CHECKOUT_ONLY or part.value.startswith(".."):
                    found.append((getattr(node, "lineno", 0), ast.unparse(node)))
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_reaches_outside_the_package(path: Path) -> None:
    found = _escapes(ast.parse(path.read_text(), filename=str(path)))
    assert not found, f"{path.relative_to(ROOT)} builds paths outside the installed package: {found}"


@pytest.mark.parametrize("source, bad", [
    ("from pathlib import Path\nREPO = Path(__file__).resolve().parents[1]\n", True),
    ("from pathlib import Path\nHERE = Path(__file__).resolve().parent\nREPO = HERE.parents[1]\n", True),
    ("from pathlib import Path\nHERE = Path(__file__).resolve().parent\nREPO = HERE.parent.parent\n", True),
    ("from pathlib import Path\nHERE = Path(__file__).resolve().parent\nX = HERE / 'run_vllm.py'\n", False),
    ("import os\nX = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\n", True),
    ("from pathlib import Path\nX = Path.cwd() / 'scripts' / 'real_vllm'\n", True),
    ("import os\nX = os.path.join(os.getcwd(), 'tests/wire/vectors')\n", True),
    ("MSG = 'run scripts/install_real_vllm.sh'\n", False),
])
def test_the_scan_sees_what_it_looks_for(source: str, bad: bool) -> None:
    assert bool(_escapes(ast.parse(source))) is bad


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``pip install zmqdispatch`` puts in site-packages, in a fresh directory."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools_cfg = project.get("tool", {}).get("setuptools", {})
    assert setuptools_cfg.get("packages", {}).get("find", {}).get("include") == ["zmqdispatch*"]
    assert "data-files" not in setuptools_cfg, "data files are declared: install them below too"
    files = _modules()
    for package, patterns in setuptools_cfg.get("package-data", {}).items():
        for pattern in patterns:
            files += sorted((ROOT / package.replace(".", "/")).glob(pattern))
    site = tmp_path_factory.mktemp("site")
    for path in files:
        dest = site / path.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    return site


def _run(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    env.pop("ZMQD_REAL_VLLM_SCRIPTS", None)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          check=False, stdin=subprocess.DEVNULL)


def test_the_installed_package_generates_outside_a_checkout(installed: Path, tmp_path: Path) -> None:
    p = _run(installed, tmp_path, "-c", "import zmqdispatch, sys; print(zmqdispatch.__file__)")
    assert p.stdout.strip() == str(installed / "zmqdispatch" / "__init__.py"), p.stderr
    p = _run(installed, tmp_path, "-m", "zmqdispatch", "generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert '"complete"' in p.stdout
    p = _run(installed, tmp_path, "-m", "zmqdispatch", "bench", "--help")
    assert p.returncode == 0 and "--real-vllm-scripts" in p.stdout, p.stderr[-3000:]


def test_bench_names_what_it_needs_when_the_real_vllm_scripts_are_absent(installed: Path, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from zmqdispatch import cli\n"
        "from zmqdispatch.bench import harness\n"
        "args = cli._build_parser().parse_args(['bench', '--vllm-python', sys.executable, '--no-plot'])\n"
        "print(harness._vllm_skip_reason(harness.BenchSettings(args)))\n"
    )
    p = _run(installed, tmp_path, "-c", code)
    assert p.returncode == 0, p.stderr[-3000:]
    reason = p.stdout.strip()
    assert "--real-vllm-scripts" in reason and "engine.py" in reason and str(tmp_path) in reason, reason
    scripts = ROOT / "scripts" / "real_vllm"
    if scripts.is_dir():
        code = code.replace("'--no-plot'", f"'--no-plot', '--real-vllm-scripts', {str(scripts)!r}")
        p = _run(installed, tmp_path, "-c", code)
        assert p.stdout.strip() == "None", p.stdout + p.stderr[-3000:]
