"""The front end's layering (issue 45, parts 4 and 5): the server is a package whose HTTP
stack stays in its app and streaming modules, the output pipeline knows no HTTP, and no
module of hybridrt/ grows past 500 lines unless listed here. Read from the source (imports
inside functions included), plus one import in a fresh process."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hybridrt"
SERVER = PKG / "server"
HTTP_STACK = {"starlette", "uvicorn", "httpx", "fastapi", "aiohttp", "ray"}
HTTP_MODULES = {"app.py", "streaming.py"}  # the server's modules that may speak HTTP
LONG_MODULES: set[str] = set()  # modules over 500 lines, each with its reason
MAX_LINES = 500


def imported(path: Path) -> set[str]:
    """The top-level packages and the hybridrt modules ``path`` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for m in mods:
            names.add(m.split(".")[0])
            names.add(m)
    return names


def test_the_server_is_a_package():
    assert not (PKG / "server.py").exists()
    assert (SERVER / "__init__.py").is_file()


def test_only_the_app_and_streaming_modules_import_the_http_stack():
    modules = sorted(SERVER.glob("*.py"))
    assert {p.name for p in modules} >= HTTP_MODULES | {"engine_loop.py", "prepare.py"}
    offenders = {p.name: sorted(imported(p) & HTTP_STACK) for p in modules
                 if p.name not in HTTP_MODULES and imported(p) & HTTP_STACK}
    assert not offenders, offenders


def test_the_output_pipeline_knows_neither_http_nor_the_server():
    names = imported(PKG / "output_pipeline.py")
    assert not names & HTTP_STACK, names & HTTP_STACK
    assert not {n for n in names if n.startswith("hybridrt.server")}


def test_importing_the_server_package_leaves_the_http_stack_unloaded():
    code = ("import sys, hybridrt.server; "
            "print(sorted(m for m in ('starlette', 'uvicorn', 'httpx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_module_of_hybridrt_is_over_500_lines_unless_listed():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= LONG_MODULES, long
