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
