"""The benchmarks stay out of the product: nothing outside ``hybridrt/bench/`` imports it but the
``hybridrt bench`` commands (cli/bench.py), and those only inside the commands. And scripts/
stands on its own: nothing in it imports from tests/, and every repository path it names
exists."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir)
PACKAGES = {"hybridrt": "hybridrt", "kernels": "hybridrt.kernels", "statecache":
            "hybridrt.statecache", "specdec": "hybridrt.specdec", "cli": "hybridrt.cli"}
ALLOWED = {"cli/bench.py"}  # the commands over the benchmarks, importing them lazily
BENCH = "hybridrt.bench"


def _is_bench(module: str) -> bool:
    return module == BENCH or module.startswith(BENCH + ".")


def _package_of(rel: Path) -> list[str]:
    return PACKAGES[rel.parts[0]].split(".") + list(rel.parts[1:-1])


def _walk(node: ast.AST, into_functions: bool):
    """``ast.walk``, or without the bodies of functions (what runs when the module is
    imported: module level, class bodies, under if / try / with)."""
    for child in ast.iter_child_nodes(node):
        if into_functions or not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                            | ast.Lambda):
            yield child
            yield from _walk(child, into_functions)


def bench_imports(source: str, rel: Path, top_level_only: bool = False) -> list[str]:
    """The imports of ``hybridrt.bench`` (or a module in it) in one file, as 'line: module';
    ``rel``: the file's path from the repository root, to resolve relative imports.
    ``top_level_only``: only those run when the module is imported (not inside a function)."""
    package = _package_of(rel)
    found = []
    for node in _walk(ast.parse(source), into_functions=not top_level_only):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            names = [node.args[0].value]
        found += [f"{node.lineno}: {n}" for n in names if _is_bench(n)][:1]
    return found


def product_files() -> list[Path]:
    files = []
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] != ("hybridrt", "bench") and rel.as_posix() not in ALLOWED:
                files.append(rel)
    return files


def test_the_product_imports_nothing_from_the_benchmarks():
    files = product_files()
    names = {f.as_posix() for f in files}
    assert {"hybridrt/engine.py", "specdec/mtp.py", "cli/main.py"} <= names  # it finds the product
    assert not names & ALLOWED and not any(n.startswith("hybridrt/bench/") for n in names)
    bad = {f.as_posix(): hits for f in files
           if (hits := bench_imports((ROOT / f).read_text(), f))}
    assert not bad, f"the product imports hybridrt.bench: {bad}"


def test_the_bench_commands_import_the_benchmarks_only_when_run():
    rel = Path("cli/bench.py")
    assert bench_imports((ROOT / rel).read_text(), rel)  # it does use them
    assert not bench_imports((ROOT / rel).read_text(), rel, top_level_only=True)


def test_the_check_sees_every_form_of_import():
    at = Path("hybridrt/engine.py")
    for line in ("import hybridrt.bench", "import hybridrt.bench.spec as s",
                 "from hybridrt.bench import spec", "from hybridrt.bench.fixtures import x",
                 "from hybridrt import bench", "from . import bench", "from .bench import spec",
                 "from .bench.spec import x", "importlib.import_module('hybridrt.bench.cuda')",
                 "def f():\n    from hybridrt.bench import spec"):
        assert bench_imports(line, at), line
    assert bench_imports("from .. import bench", Path("kernels/cuda/x.py")) == []  # h.kernels
    assert bench_imports("from ... import bench", Path("kernels/cuda/x.py"))
    assert bench_imports("from ..bench import spec", Path("specdec/mtp.py"))
    for line in ("import hybridrt.benchmarks", "from hybridrt import engine",
                 "from .specdec import mtp", "'hybridrt.bench.spec'  # a string"):
        assert not bench_imports(line, at), line
    assert not bench_imports("def f():\n    from hybridrt.bench import spec", at,
                             top_level_only=True)
    assert bench_imports("try:\n    from hybridrt.bench import spec\nexcept ImportError: pass",
                         at, top_level_only=True)


def test_importing_the_library_and_the_cli_loads_no_benchmark(tmp_path):
    code = ("import sys, hybridrt, hybridrt.llm, hybridrt.cli.main; "
            "print(sorted(m for m in sys.modules if m.startswith('hybridrt.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout  # (not the root: its hybridrt/ shadows)
    assert out.strip() == "[]"


def test_scripts_hold_only_the_demo_pipeline_and_the_device_check():
    names = {p.relative_to(ROOT / "scripts").as_posix() for p in (ROOT / "scripts").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert names == {"device_check.sh", "demo/make_corpus.py", "demo/train.py",
                     "demo/train_vision.py", "demo/evaluate.py"}, \
        "a measurement belongs in hybridrt bench"


def test_the_tests_check_sees_every_form_of_import():
    """imports_of_tests on lines that do and do not reach into tests/."""
    for line in ("import tests.helpers", "from tests import helpers", "from tests.gpu import x",
                 "sys.path.insert(0, str(ROOT / 'tests'))", "sys.path.append('tests/gpu')",
                 "def f():\n    import tests"):
        assert imports_of_tests(line), line
    for line in ("import testsuite", "from hybridrt import tests_x", "x = 'tests'",
                 "sys.path.insert(0, '/tmp/pkg')"):
        assert not imports_of_tests(line), line


def imports_of_tests(source: str) -> list[str]:
    """Imports of the tests package, and ``sys.path`` changes naming a tests folder, in one
    file, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names
                      if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "tests":
                found.append(f"{node.lineno}: {node.module}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("insert", "append", "extend")
              and ast.unparse(node.func.value) == "sys.path"
              and re.search(r"\btests\b", ast.unparse(node))):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_in_scripts_imports_from_tests():
    files = sorted((ROOT / "scripts").rglob("*.py"))
    assert files
    bad = {f.relative_to(ROOT).as_posix(): hits for f in files
           if (hits := imports_of_tests(f.read_text()))}
    assert not bad, f"scripts/ reaches into tests/: {bad}"


TOP = ("docs", "hybridrt", "kernels", "statecache", "specdec", "cli", "tests", "scripts")
PATH = re.compile(r"(?<![\w.-])(?:\$REPO/|\$PWD/)?((?:" + "|".join(TOP) + r")/[\w./-]*)")


def repo_paths(text: str) -> list[str]:
    """The repository paths a file names: words starting with a top-level folder of the repo
    (alone, or after $REPO/ or $PWD/), trailing dots dropped; not after another folder
    (shared/docs/... lies outside the repo)."""
    return [m.group(1).rstrip(".") for m in PATH.finditer(text)
            if not text[:m.start()].endswith("/")]


def test_repo_paths_finds_what_a_script_names():
    assert repo_paths("see docs/cuda.md, and $REPO/tests/gpu/x.py; kernels/...") == [
        "docs/cuda.md", "tests/gpu/x.py", "kernels/"]
    assert repo_paths("shared/docs/qwen35.md my_docs/x hybridrt.bench") == []


def test_every_path_a_script_names_exists():
    files = sorted(p for p in (ROOT / "scripts").rglob("*") if p.suffix in (".py", ".sh"))
    missing = {f.relative_to(ROOT).as_posix(): gone for f in files
               if (gone := [p for p in repo_paths(f.read_text()) if not (ROOT / p).exists()])}
    assert not missing, f"scripts/ names paths that do not exist: {missing}"
