"""What the kernels and backends are told at start-up, instead of reading the environment.

``hybridrt/env.py`` fills a ``KernelOptions`` from the ``HYBRIDRT_*`` variables once, when an
engine starts, and hands it to ``select_backend``; a backend built without one gets the
defaults below (those of an unset environment). Nothing in ``kernels/`` reads ``os.environ``
for these.
"""

from __future__ import annotations

from dataclasses import dataclass

# the vector loops of csrc/gdn_fused.c and csrc/attn_decode.c: the widest the build has
SIMD_AVX512, SIMD_AVX2, SIMD_PLAIN = 2, 1, 0


@dataclass(frozen=True, slots=True)
class KernelOptions:
    native: bool = True  # use the compiled CPU kernels (kernels/native.py) where they build
    cache_dir: str | None = None  # where they are built (None: ~/.cache/hybridrt)
    half_path: str = "auto"  # bf16 x bf16 products: "auto" (the fastest built), "fma", "bf16dot"
    fused_simd: int = SIMD_AVX512  # the fused layers' vector loops: at most AVX-512, AVX2, plain
    int8_isa: str | None = None  # int8 products: None (the best built), "ref", "avx2", "vnni"
    int4_isa: str | None = None  # 4-bit products: None (the best built), "ref", "avx2",
    # "avxvnni", "vnni"
    int4_prefetch: str = "auto"  # one-row 4-bit products' prefetch: "auto", "nta", "l2"
    march: str = "native"  # the target the C kernels are compiled for (cc -march=...)
    huge_pages: bool = True  # loaded weights in transparent-huge-page memory where the OS has it
    step_program: bool = True  # decode steps' layers in one compiled call (kernels/step.py)
    # every row's result independent of the batch, chunking and speculation around it
    # (docs/batch_invariance.md): set by LLM(batch_invariant=True), not by the environment
    batch_invariant: bool = False
