"""Batched tensor copies for the memory pools: bookkeeping first, then every copy of a batch in one call.

``copy_all(pairs)`` copies each ``(dst, src)`` pair of flat ``uint8`` tensors in order: adjacent pairs merged
(``coalesced``), then one ``torch._foreach_copy_`` (a C++ loop, no per-copy Python dispatch) when every tensor is
on one device, else one ``copy_`` each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def coalesced(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same copies (flat ``uint8`` pairs), consecutive ones merged where both the destinations and the
    sources follow each other in memory (records of one batch put in consecutive slots, payloads that are
    slices of one gathered tensor): one large copy instead of many small ones. A merged pair spans memory of
    the first pair's storages only (``as_strided`` checks the bounds; out of bounds means a different
    allocation that merely happens to follow, and is not merged)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    run: list[tuple[torch.Tensor, torch.Tensor]] = []
    end_d = end_s = -1

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            total = sum(d.numel() for d, _ in run)
            d0, s0 = run[0]
            try:
                out.append((d0.as_strided((total,), (1,)), s0.as_strided((total,), (1,))))
            except RuntimeError:  # crosses the end of a storage: keep the pieces
                out.extend(run)
        run.clear()

    for dst, src in copies:
        n = dst.numel()
        if not (run and dst.data_ptr() == end_d and src.data_ptr() == end_s and dst.device == run[0][0].device
                and src.device == run[0][1].device):
            flush()
        run.append((dst, src))
        end_d, end_s = dst.data_ptr() + n, src.data_ptr() + n
    flush()
    return out


def copy_all(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair (flat ``uint8``), in order: adjacent pairs merged (``coalesced``),
    then one ``torch._foreach_copy_`` call (the loop runs in C++) when every tensor is on one device, else one
    ``copy_`` each (host-device pairs)."""
    if len(copies) > 1:
        copies = coalesced(copies)
    if not copies:
        return
    dsts = [d for d, _ in copies]
    srcs = [s for _, s in copies]
    device = dsts[0].device
    if len(copies) > 1 and all(t.device == device for t in (*dsts, *srcs)):
        torch._foreach_copy_(dsts, srcs)
        return
    for dst, src in copies:
        dst.copy_(src)
