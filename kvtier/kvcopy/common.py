"""What both copy families share: wide element views of the same bytes, and block-id index tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Element types to view the bytes as, widest first (measured fastest: int64 for index_select, 16-byte complex
# for index_copy_; both copy bits unchanged).
GATHER_DTYPES = (torch.int64, torch.int32)
SCATTER_DTYPES = (torch.complex128, torch.int64, torch.int32)


def wide(layers: Sequence[torch.Tensor], payloads: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]
         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same bytes viewed with the widest elements every tensor allows: index kernels copy element by
    element, so 8-byte elements move 4x fewer of them than bf16. Unchanged when any view is impossible."""
    size = layers[0].element_size()
    for dtype in dtypes:
        if dtype.itemsize <= size:
            break
        try:
            return [t.view(dtype) for t in layers], [p.view(dtype) for p in payloads]
        except RuntimeError:  # last dim not contiguous or not a multiple of the wider element
            continue
    return list(layers), list(payloads)


def index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on ``device``."""
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def spacing(chunks: Sequence[torch.Tensor]) -> int | None:
    """The fixed distance in elements between consecutive payloads that lie in one storage without overlapping
    (records of one put in consecutive pool slots, or one stacked tensor), else None."""
    first = chunks[0]
    storage, step = first.untyped_storage().data_ptr(), first.numel()
    for i in range(1, len(chunks)):
        cur = chunks[i]
        gap, rest = divmod(cur.data_ptr() - chunks[i - 1].data_ptr(), cur.element_size())
        if cur.untyped_storage().data_ptr() != storage or rest or gap < cur.numel() or (i > 1 and gap != step):
            return None
        step = gap
    return step
