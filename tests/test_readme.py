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
    assert blocks
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


def command_lines(text: str) -> list[str]:
    """The ``hybridrt ...`` and ``python -m hybridrt ...`` command lines of a markdown text's
    bash blocks and inline code, continuation lines joined, comments dropped, from the word
    after ``hybridrt`` on."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found.append(line.split("  #")[0].split(" # ")[0])
    found += re.findall(r"`((?:python -m )?hybridrt [^`\n]*)`", text)
    out = []
    for line in found:
        # not Python's "from hybridrt import ..." inside a python -c line
        m = re.search(r"(?:^|[\s;&|(])(?<!from )(?:python -m )?hybridrt ((?:[^;&|()`]|\$\()*)",
                      line)
        if m and not m.group(1).startswith(".") and "..." not in m.group(1):
            out.append(m.group(1).strip())
    return out


def test_command_lines_finds_what_a_doc_runs():
    text = ("```bash\nhybridrt chat --no-think   # a comment --bogus\nnice hybridrt bench "
            "gemv \\\n    --threads 2\n```\nand `python -m hybridrt bench prefix /tmp/r --rounds"
            " 1`; not `hybridrt.bench.spec`, `python -m hybridrt.bench.cuda --x`, `hybridrt "
            "bench ...` nor `what hybridrt would do`.")
    assert command_lines(text) == ["chat --no-think", "bench gemv      --threads 2",
                                   "bench prefix /tmp/r --rounds 1"]


def _unknown(words: list[str]) -> str | None:
    """What of a command line (after ``hybridrt``) the CLI would not take: an unknown command
    or an option its command lacks; None if it takes every word."""
    import typer

    from hybridrt.cli.main import app

    cmd = typer.main.get_command(app)
    path = []
    while hasattr(cmd, "commands") and words and not words[0].startswith("-"):
        if words[0] not in cmd.commands:
            return f"no command {' '.join(path + [words[0]])}"
        path.append(words[0])
        cmd = cmd.commands[words.pop(0)]
    opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
    for w in words:
        flag = w.split("=")[0]
        if flag.startswith("-") and not re.fullmatch(r"-\d.*", flag) and flag not in opts:
            return f"hybridrt {' '.join(path)} takes no {flag}"
    return None


def test_every_command_line_in_the_docs_is_one_the_cli_takes():
    """Each ``hybridrt ...`` line of README.md and docs/*.md (not docs/history/, whose lines
    were run by earlier versions) names a command that exists and only options it has."""
    import shlex

    root = README.parent
    docs = [README, *sorted((root / "docs").glob("*.md"))]
    wrong = {}
    for doc in docs:
        for line in command_lines(doc.read_text()):
            try:
                words = shlex.split(line)
            except ValueError:
                words = line.split()
            if (why := _unknown(words)) is not None:
                wrong.setdefault(doc.relative_to(root).as_posix(), []).append(f"{line}: {why}")
    assert not wrong, wrong
