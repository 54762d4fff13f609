"""``kernels/`` is a leaf: nothing in it imports from ``hybridrt`` outside ``hybridrt.kernels``
(the product imports the kernels, never the other way round)."""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def upward_imports(path: Path) -> list[str]:
    """The ``hybridrt.*`` modules outside ``hybridrt.kernels`` that ``path`` imports (at any
    depth of the file: a lazy import inside a function counts too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            # a relative import climbing out of kernels/ (from ... import x in kernels/cuda)
            depth = len(path.relative_to(KERNELS).parts) - 1
            names = ["hybridrt"] if node.level > depth + 1 else []
        else:
            continue
        found += [n for n in names if (n == "hybridrt" or n.startswith("hybridrt."))
                  and n != "hybridrt.kernels" and not n.startswith("hybridrt.kernels.")]
    return found


def test_upward_imports_are_found(tmp_path):
    bad = KERNELS / "_probe_for_the_test.py"
    try:
        bad.write_text("def f():\n    from hybridrt.model import MLP\n    import hybridrt.env\n"
                       "from hybridrt.kernels import native\n")
        assert upward_imports(bad) == ["hybridrt.model", "hybridrt.env"]
    finally:
        bad.unlink()


def test_kernels_import_nothing_from_hybridrt_outside_kernels():
    files = sorted(KERNELS.rglob("*.py"))
    assert len(files) > 10
    offenders = {str(f.relative_to(KERNELS)): upward_imports(f) for f in files}
    assert {f: names for f, names in offenders.items() if names} == {}


def _kernel_imports(path: Path) -> set[str]:
    """The ``hybridrt.kernels`` modules ``path`` imports, as dotted names under kernels/."""
    pkg = ["hybridrt", "kernels", *path.relative_to(KERNELS).parts[:-1]]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = (pkg[:len(pkg) - node.level + 1] if node.level else [])
            mod = ".".join(base + ([node.module] if node.module else []))
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m.removeprefix("hybridrt.") for m in out if m.startswith("hybridrt.kernels")}


def test_only_select_backend_imports_the_cuda_backend_and_it_imports_no_select():
    """No circle: ``kernels/cuda/backend.py`` builds on the plan and reference modules, and
    only ``select_backend`` (lazily) imports it."""
    importers = sorted(str(f.relative_to(KERNELS)) for f in KERNELS.rglob("*.py")
                       if "kernels.cuda.backend" in _kernel_imports(f))
    assert importers == ["backend/select.py"]
    cuda = _kernel_imports(KERNELS / "cuda" / "backend.py")
    assert {"kernels.backend.plan", "kernels.backend.reference"} <= cuda
    assert not {m for m in cuda if m.startswith("kernels.backend.select")
                or m.startswith("kernels.backend.cpu") or m == "kernels.backend"}


def _run_at_root(code: str, *flags: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, *flags, "-c", code], cwd=KERNELS.parent,
                          capture_output=True, text=True, timeout=120)


def test_a_top_level_kernels_import_at_the_clone_root_gets_the_installed_package(tmp_path):
    """At the clone's root (first on sys.path) ``import kernels`` would find the folder that is
    ``hybridrt.kernels``; transformers (>= 5.25) imports Hugging Face's ``kernels`` package by
    that name. The folder hands the import over to an installed package of the name, and
    ``hybridrt.kernels`` still imports as itself in the same process."""
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'installed'\n")
    out = _run_at_root(
        f"import sys; sys.path.insert(1, {str(tmp_path / 'site')!r}); "
        "import kernels; print(kernels.WHO); "
        "import hybridrt.kernels as k; print(k.__name__, callable(k.rms_norm))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["installed", "hybridrt.kernels", "True"]


def test_a_top_level_kernels_import_at_the_clone_root_without_the_package_says_what_it_is():
    out = _run_at_root("import kernels", "-S")  # -S: no site-packages, no installed kernels
    assert out.returncode != 0
    assert "is hybridrt.kernels, not the package 'kernels' (not installed)" in out.stderr
