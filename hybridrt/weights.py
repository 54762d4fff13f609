"""Where a bound model's weights live: projections merged into one matrix per group, and the
weights a decode step streams moved into transparent-huge-page memory.

The model side knows which projections read the same input (a GDN layer's four, attention's
q/k/v, the MLP's gate/up); a backend only says what it wants (``merges_projections``,
``huge_pages``) and receives the groups (``bind``). Nothing here chooses a kernel.
"""

from __future__ import annotations

import torch

from hybridrt.kernels import int4, quant
from hybridrt.kernels.memory import HugeArena, populate, release_pages

Groups = dict[tuple[int, ...], tuple[torch.Tensor, list[int]]]


def place_weights(model, merge: bool, huge_pages: bool) -> Groups:
    """Lay out ``model``'s weights as a backend asked: ``merge``: ``merge_projections``;
    ``huge_pages``: every streamed weight (the merged groups built there, the rest copied) in
    one ``HugeArena`` (only for a model that owns its weights, as the loader's does) -> the
    merged groups ({} without ``merge``)."""
    owns = getattr(model, "owns_weights", False)
    if merge:
        widen_mixed_groups(model)
    mats, quants = streamed_weights(model) if owns and huge_pages else ([], [])
    arena = None
    if mats or quants:
        arena = HugeArena(HugeArena.size_for(
            [w for _, w in mats] + [t for _, q in quants for t in q.tensors()]))
    groups = {}
    if merge:
        groups = merge_projections(model, release=owns, alloc=arena.empty if arena else None)
    for m, w in mats:  # the rest (merged ones now lie in the arena)
        if m.weight is w:
            m.weight = torch.nn.Parameter(arena.move(w.detach()), requires_grad=False)
    for m, q in quants:
        if m.qweight is q:
            m.qweight = q.replace(*(arena.move(t) for t in q.tensors()))
    if arena is not None:
        arena.settle()  # into huge pages, in the background where the kernel can
    if owns and huge_pages:  # the routed experts stay mapped: their pages mapped in ahead
        populate(expert_tensors(model))
    return groups


def widen_mixed_groups(model) -> None:
    """A projection group whose weights are in 4 and 6 bits (a GGUF Q4_K_M file keeps some in
    Q6_K) takes its 4-bit ones in the 6-bit format, the same values, so that it merges (the
    decode loop and its compiled step need every layer's projections merged)."""
    for mods in model.projection_groups():
        qs = [getattr(x, "qweight", None) for x in mods]
        if {type(q) for q in qs} == {int4.Int4Weight, int4.Int6Weight}:
            for x, q in zip(mods, qs):
                if q.bits == 4:
                    x.qweight = int4.widened(q)


def merge_projections(model, release: bool = False, alloc=None) -> Groups:
    """Concatenate the weights of projections that read the same input (the model's
    ``projection_groups()``) -> {ids of the modules' new weights (``quant.kernel_weight``):
    (weight, output sizes)}; each module's weight
    becomes a view into its group's, so no memory is added and one product serves the group
    (quantized weights, ``quant.PackedWeight``, likewise, when all are of one kind and every
    output size is a whole number of panels).
    Groups whose weights differ in dtype or are not plain tensors are left.
    ``release``: give the replaced weights' pages back to the OS at once (CPU, for a model that
    is the only owner of its weights, as the loader's is: its tensors share a file mapping
    that the other weights keep alive, so they would stay resident). ``alloc(shape, dtype)``:
    where the merged weights go (default: ``torch.empty`` on the weights' device; a
    ``HugeArena``'s ``empty``)."""
    groups = {}
    for mods in model.projection_groups():
        qs = [getattr(x, "qweight", None) for x in mods]
        if all(q is not None and q.shape[0] % quant.PANEL == 0 and type(q) is type(qs[0])
               for q in qs):
            merged, parts = quant.concat(qs, release, alloc)
            for x, part in zip(mods, parts):
                x.qweight = part
            groups[tuple(id(x.qweight) for x in mods)] = (merged, [q.shape[0] for q in qs])
            continue
        ws = [getattr(x, "weight", None) for x in mods]
        if any(w is None or w.dtype != ws[0].dtype or w.dim() != 2 for w in ws):
            continue
        shape = (sum(x.shape[0] for x in ws), ws[0].shape[1])
        w = (alloc(shape, ws[0].dtype) if alloc is not None
             else torch.empty(shape, dtype=ws[0].dtype, device=ws[0].device))
        torch.cat([x.detach() for x in ws], out=w)
        sizes, off = [], 0
        for x in mods:
            n = x.weight.shape[0]
            x.weight = torch.nn.Parameter(w[off:off + n], requires_grad=False)
            sizes.append(n)
            off += n
        if release:  # the sources' pages leave memory now, not when the file mapping does
            for old in ws:
                release_pages(old)
        groups[tuple(id(x.weight) for x in mods)] = (w, sizes)
    return groups


def is_expert(name: str) -> bool:
    """Whether the module ``name`` is (in) an MoE block's routed experts."""
    return ".experts." in f".{name}."


def expert_tensors(model) -> list[torch.Tensor]:
    """The routed experts' weight tensors (a quantized one's parts)."""
    out = []
    for name, m in model.named_modules():
        if is_expert(name):
            q = getattr(m, "qweight", None)
            if isinstance(q, quant.PackedWeight):
                out += q.tensors()
            elif isinstance(getattr(m, "weight", None), torch.Tensor):
                out.append(m.weight)
    return out


def streamed_weights(model) -> tuple[list, list]:
    """What a decode step streams, for ``place_weights``' arena: (module, weight) for every
    Linear and Embedding whose weight is a whole CPU half-precision matrix, and (module,
    PackedWeight) for every quantized one (a Linear's, or the quantized embedding, the tied LM
    head). An MoE block's routed experts are left where the loader put them (the checkpoint's
    file mapping): a step reads k of them, and copying them all would double the start-up's
    memory traffic (19 GiB of the 35B-A3B shape in 4 bits) for pages mostly not read; so is an
    embedding that is not also the LM head (a step reads one row of it)."""
    untied = getattr(model, "lm_head", None) is not None
    mats, quants = [], []
    for name, m in model.named_modules():
        if is_expert(name) or (untied and name.endswith("embed_tokens")):
            continue
        q = getattr(m, "qweight", None)
        if isinstance(q, quant.PackedWeight) and q.device.type == "cpu":
            quants.append((m, q))
            continue
        if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        w = m.weight
        if (w is not None and w.dtype in (torch.bfloat16, torch.float16) and w.dim() == 2
                and w.device.type == "cpu" and w.is_contiguous()
                and w.untyped_storage().nbytes() == w.numel() * w.element_size()):
            mats.append((m, w))
    return mats, quants
