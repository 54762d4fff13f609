"""Test-side patches that let fla's Triton kernels run under ``TRITON_INTERPRET=1``.

Import this module before the first fla kernel runs (test files only, never library code). It
does nothing unless ``TRITON_INTERPRET=1``. Four problems, all in how kernels meet the
interpreter, not in the kernels (3 and 4 concern any kernel with bf16 data, not only fla's),
one shortcut (5) and one opt-in emulation (6):

1. fla autotunes most kernels over several configs; the interpreter has no GPU driver to time
   them with (``RuntimeError: 0 active drivers``). The autotuner is cut to its first config
   (after the kernel's own pruning): any config is correct, timing is meaningless here.
2. Some kernels call ``.to()`` on a ``range`` loop variable (``for i_t in range(NT):
   i_t.to(tl.int64)``): compiled, it is a tensor; interpreted, a Python int
   (``AttributeError: 'int' object has no attribute 'to'``). The interpreter already rewrites
   each kernel's AST (every assignment becomes ``to_tensor(value)``); we extend that rewrite
   so that a ``for`` loop whose body calls ``<loop variable>.to(...)`` starts with
   ``<loop variable> = <loop variable>``, i.e. the variable becomes a tensor. Other loops
   (``tl.static_range`` indices used as Python ints) are left alone.
3. The interpreter keeps bfloat16 data as raw uint16 bits (numpy has no bfloat16) and its
   ``tl.dot`` multiplies those bits as integers (garbage ~1e9 for bf16 q/k/v; triton 3.9).
   Kernels convert bf16 to fp32 before other arithmetic, but feed bf16 tiles to ``tl.dot``
   (fp32 accumulation), as fla does. bf16 operands are widened to fp32 (exact) first, which is
   what the GPU's bf16 MMA with fp32 accumulation computes.
4. The interpreter's fp32 -> bf16 conversion (``x.to(tl.bfloat16)``) truncates (rounds toward
   zero) where the GPU rounds to nearest even, and its explicit round-to-nearest path drops the
   carry into the exponent. Truncation biases every bf16 intermediate towards zero, which
   inflates fla's bf16 output error against an fp32 reference far beyond the ratio of bf16's
   to fp16's precision. fp32 -> bf16 now rounds to nearest even (through torch), except where
   a kernel asks for round-toward-zero.
5. Speed only: a ``@triton.jit`` function called from inside a kernel (``tl.sum``,
   ``tl.zeros`` and the rest of ``triton.language.standard``, or a kernel's own helpers)
   re-patches ``triton.language`` on every call (``InterpretedFunction.__call__`` walks the
   members of ``tl``, ``tl.tensor``, ``tl.math`` with ``inspect.getmembers``): a fifth of the
   interpreter's time in the engine tests. The modules are patched already while a kernel
   runs (those the kernel's module sees), or for good (what a helper's call patched in other
   modules is never undone): a helper whose language modules are all patched is called
   straight away. The patched functions are the same, so nothing computed changes.
6. ``HYBRIDRT_INTERPRET_TF32=1``: ``tl.dot`` on fp32 operands at the default (or an explicit
   "tf32") input precision rounds both operands to tf32 (10 mantissa bits, to nearest) before
   the fp32 product, as a GPU's tensor cores do; the interpreter otherwise multiplies in full
   fp32. fla's chunked delta rule uses the default precision, so this shows on CPU what its
   fp32 prefill computes on a GPU (tests/gpu/test_cuda_backend.py's fp32 test then applies
   its GPU rule).
"""

from __future__ import annotations

import ast
import inspect
import os

ACTIVE = os.environ.get("TRITON_INTERPRET") == "1"
TF32 = ACTIVE and os.environ.get("HYBRIDRT_INTERPRET_TF32") == "1"


def round_to_tf32(x):
    """fp32 numpy array -> the same values rounded to tf32 (10 mantissa bits, ties to even),
    still fp32. Inf and NaN pass through."""
    import numpy as np

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = (bits & 0x7F800000) != 0x7F800000
    lsb = (bits >> 13) & 1
    rounded = ((bits + np.uint32(0xFFF) + lsb) & np.uint32(0xFFFFE000)).astype(np.uint32)
    return np.where(finite, rounded, bits).view(np.float32)


def _calls_to(var: str, body: list[ast.stmt]) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == "to"
        and isinstance(n.value, ast.Name) and n.value.id == var
        for stmt in body for n in ast.walk(stmt)
    )


def _apply() -> None:
    from triton.runtime import autotuner, interpreter

    if getattr(autotuner.Autotuner, "_hybridrt_patched", False):
        return
    prune = autotuner.Autotuner.prune_configs

    def prune_configs(self, kwargs):
        return prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = prune_configs
    autotuner.Autotuner._hybridrt_patched = True

    class _LoopVarAsTensor(interpreter.ASTTransformer):
        def visit_For(self, node):
            t = node.target
            if isinstance(t, ast.Name) and _calls_to(t.id, node.body):
                node.body.insert(0, ast.Assign(
                    targets=[ast.Name(id=t.id, ctx=ast.Store())],
                    value=ast.Name(id=t.id, ctx=ast.Load()),
                ))
            return self.generic_visit(node)  # the inserted Assign is wrapped in to_tensor

    interpreter.FunctionRewriter.ast_transformer = _LoopVarAsTensor()

    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl

        def wide(x):
            return self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x

        if (TF32 and input_precision == interpreter._ir.INPUT_PRECISION.TF32
                and a.dtype.scalar == tl.float32 and b.dtype.scalar == tl.float32):
            a = interpreter.TensorHandle(round_to_tf32(a.data), a.dtype.scalar)
            b = interpreter.TensorHandle(round_to_tf32(b.data), b.dtype.scalar)
        if d.dtype.scalar == tl.bfloat16:
            out = dot(self, wide(a), wide(b), wide(d), input_precision, max_num_imprecise_acc)
            return self.cast_impl(out, tl.bfloat16)
        return dot(self, wide(a), wide(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot

    cast = builder.cast_impl
    fp_to_fp = builder.create_fp_to_fp

    def to_bf16_rtne(src):
        import numpy as np
        import torch

        x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits.reshape(src.data.shape), _bf16())

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == _fp32() and dst_type.scalar == _bf16():
            return to_bf16_rtne(src)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if (src.dtype.scalar == _fp32() and dst_type.scalar == _bf16()
                and rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ):
            return to_bf16_rtne(src)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    # the lambdas (create_fp_trunc etc.) call self.cast_impl: they pick up the patched one

    _skip_repatching_in_kernels(interpreter)


def _skip_repatching_in_kernels(interpreter) -> None:
    import triton.language as tl

    langs: dict[int, frozenset] = {}  # id(function) -> ids of the language modules it sees

    def seen(fn) -> frozenset:
        key = id(fn)
        if key not in langs:
            langs[key] = frozenset(id(v) for v in list(fn.__globals__.values())
                                   if inspect.ismodule(v) and v in (tl, tl.core))
        return langs[key]

    running: list[frozenset] = []  # the language modules each running kernel patched
    # and those a helper's call patched for good: the interpreter never undoes that, except
    # where the running kernel's own patching (which it undoes at its end) covered the module
    for_good: set[int] = set()
    launch = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__

    def launch_kernel(self, *args, **kwargs):
        running.append(seen(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.pop()

    def call_helper(self, *args, **kwargs):
        mods = seen(self.fn)
        if not running or not mods <= running[-1] | for_good:
            for_good.update(mods - running[-1] if running else mods)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch_kernel
    interpreter.InterpretedFunction.__call__ = call_helper


def _bf16():
    import triton.language as tl
    return tl.bfloat16


def _fp32():
    import triton.language as tl
    return tl.float32


if ACTIVE:
    _apply()
