"""``kernels/`` is a leaf: nothing in it imports from ``hybridrt`` outside ``hybridrt.kernels``
(the product imports the kernels, never the other way round); and the backends read the model
only as records (``kernels/backend/layers.py``), never its module tree."""

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


def _module_tree_names() -> set[str]:
    """The attribute names that walk the model's module tree: every submodule's name in a
    small model with its MTP head and an untied LM head (built on the meta device), the
    properties of its modules below the top one (``mixer``, ``spec``, ``in_projections``...),
    and nn.Module's own walks."""
    import torch

    from hybridrt.bench.fixtures import tiny_text_config
    from hybridrt.config import ModelConfig
    from hybridrt.model import Qwen35ForCausalLM

    config = ModelConfig.from_dict(tiny_text_config(mtp_num_hidden_layers=1,
                                                      tie_word_embeddings=False))
    with torch.device("meta"):
        net = Qwen35ForCausalLM(config, with_mtp=True)
    names = {part for name, _ in net.named_modules() for part in name.split(".")
             if part and not part.isdigit()}
    names |= {attr for m in net.modules() if m is not net
              for cls in type(m).__mro__ if cls.__module__ == "hybridrt.model"
              for attr, value in vars(cls).items() if isinstance(value, property)}
    return names | {"modules", "named_modules", "children", "named_children",
                    "projection_groups", "forward_eager"}


TREE_NAMES = _module_tree_names()


def tree_reads(path: Path) -> list[str]:
    """``line: .name`` for each attribute of ``path`` named like a part of the model's module
    tree (``model.model.layers``, ``dl.mixer.in_proj_qkv``, ``layer.mlp.gate_proj``...), and
    ``line: import hybridrt.model`` for an import of the model."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in TREE_NAMES:
            found.append((node.lineno, f"{node.lineno}: .{node.attr}"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""])
            found += [(node.lineno, f"{node.lineno}: import {m}") for m in mods
                      if m == "hybridrt.model" or m.startswith("hybridrt.model.")
                      or m.endswith(".model") and node.level > 0]
    return [text for _, text in sorted(found)]


def test_tree_reads_are_found():
    assert {"model", "layers", "mixer", "mlp", "in_proj_qkv", "embed_tokens", "lm_head",
            "input_layernorm", "spec"} <= TREE_NAMES
    bad = KERNELS / "backend" / "_probe_for_the_test.py"
    try:
        bad.write_text("from hybridrt.model import MLP\n"
                       "def f(model, dl):\n"
                       "    n = len(model.model.layers)\n"
                       "    w = dl.mixer.in_proj_qkv.weight\n"
                       "    return dl.mlp.gate_proj, dl.spec, n, w\n")
        assert tree_reads(bad) == [
            "1: import hybridrt.model", "3: .layers", "3: .model", "4: .in_proj_qkv",
            "4: .mixer", "5: .gate_proj", "5: .mlp", "5: .spec"]
    finally:
        bad.unlink()


def test_backends_read_records_not_the_model_tree():
    """kernels/backend/ and kernels/cuda/ (and the CPU step program) read what the model
    hands them (records, tensors), never its modules."""
    files = sorted([*(KERNELS / "backend").glob("*.py"), *(KERNELS / "cuda").glob("*.py"),
                    KERNELS / "step.py"])
    assert len(files) > 10
    offenders = {str(f.relative_to(KERNELS)): tree_reads(f) for f in files}
    assert {f: reads for f, reads in offenders.items() if reads} == {}


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
