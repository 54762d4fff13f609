"""Everything ``hybridrt bench ...`` runs, and the random-weight fixtures the tests share.

throughput (against transformers and llama.cpp, and the CPU GEMM paths), spec (speculative
decoding), serve (a loopback load test of ``hybridrt serve``), preemption (the scheduler's
admission rules under memory pressure), busy (decode beside a busy process), startup, quality
(int8 against bf16), ceilings (what the machine allows), llamacpp (the llama.cpp driver;
llamacpp_build and llamacpp_convert build it and the GGUFs it runs), cuda
(``python -m hybridrt.bench.cuda``, the GPU benchmark), fixtures (tiny and 0.8B-shaped
configs, random checkpoints, a character tokenizer, the transformers reference model).

The product (the rest of hybridrt, kernels, statecache, specdec, and cli but for cli/bench.py,
whose commands import these modules when they run) imports nothing from here:
tests/test_bench_layout.py checks it. Import the submodules themselves; this file imports none
of them.
"""

from hybridrt.kernels import memory as _memory

# benchmarks time the weights as they run once in huge pages: the arenas take them as they fill
# (the product's default moves them after the first token, in the background)
_memory.settle_at_load = True
