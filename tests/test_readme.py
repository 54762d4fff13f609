"""The README's Python examples run verbatim on the embedded demo model."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_api_examples_run_verbatim(capsys):
    import torch

    threads = torch.get_num_threads()  # the example sets them, process-wide
    try:
        _run_python_api_examples(capsys)
    finally:
        torch.set_num_threads(threads)


def _run_python_api_examples(capsys):
    text = README.read_text()
    section = text[text.index("## Python API"):text.index("## Demo model")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "error: prompt is empty" in out  # the example shows a refused request
    assert namespace["llm"].engine.cache.all_free()


def test_ci_installs_torch_as_the_readme_says():
    """The README's torch command (the CPU index) is the one CI tries first, with the same pin
    in both CI environments, and the GPU tests' fla-core pin is the gpu extra's."""
    root = README.parent
    text = README.read_text()
    m = re.search(r"pip install torch==(\S+) --index-url (\S+)", text)
    assert m, "the README's torch install command"
    version, index = m.groups()
    pip_torch = (root / ".ci" / "pip-torch").read_text()
    assert f"torch=torch=={version}\n" in pip_torch and f"index={index}\n" in pip_torch
    assert '--index-url "$index"' in pip_torch
    triton_tests = (root / ".ci" / "triton-tests").read_text()
    assert "bash .ci/pip-torch" in triton_tests and f"torch=={version} " in triton_tests
    assert "bash .ci/pip-torch" in (root / ".ci" / "run").read_text()
    fla = re.search(r"fla-core==(\S+)\"", (root / "pyproject.toml").read_text()).group(1)
    assert f"fla-core=={fla} " in triton_tests


def test_the_readme_jsonl_example_answers_every_line(tmp_path):
    """The Command line section's JSONL example, run verbatim (its printf and its generate):
    every line gets an answer (a plain-text line without --chat would end at once)."""
    import json
    import os
    import subprocess
    import sys

    text = README.read_text()
    section = text[text.index("## Command line"):]
    lines = section.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("printf "))
    cmd = "\n".join(lines[start:start + 3]).split("   #")[0]
    cmd = cmd.replace("--chat  # text lines as chat", "--chat")
    assert "generate --input prompts.jsonl --output out.jsonl" in cmd
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-c", cmd + " --no-progress --seed 0"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == 2 and all(o["text"].strip() for o in out), out
