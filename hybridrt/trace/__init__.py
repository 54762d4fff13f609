"""Tracing: the five variables of every engine step (docs/five-variables.md).

| module | owns |
| --- | --- |
| recorder | ``TraceRecorder``: the engine observer that records each step |
| invariants | ``check_trace``: the source documents' invariants, read from a trace |
| render_text | the per-step table (``hybridrt trace``) |
| render_html | one self-contained HTML page: the steps as a timeline |
"""

from hybridrt.trace.invariants import INVARIANTS, Violation, check_trace
from hybridrt.trace.recorder import TraceRecorder

__all__ = ["INVARIANTS", "TraceRecorder", "Violation", "check_trace"]
