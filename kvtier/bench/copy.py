"""The copy of a hit into the engine's blocks beside a plain memory copy of the same bytes: ``kvtier bench copy``.

A load from a memory tier scatters borrowed records (payloads ``[L, bpc, page]`` in consecutive pool slots) into a
group's page layers (``[blocks, page]``, the ``pages`` layout of vLLM >= 0.32) with ``kvtier.kvcopy.transfer.scatter``.
This times that scatter for the block orders an engine hands out (vLLM: fresh blocks ascending, reused ones
descending, and scattered ones) against the limit, one ``copy_`` of one contiguous buffer of the same bytes, in
interleaved rounds on the same thread. Defaults are the shape of ``kvtier bench vllm`` at 2048 tokens: 8 layers,
64 KiB pages (32 tokens x 4 KV heads x 64 x K and V, float32), 32 chunks of 2 blocks (32 MiB). Every scatter's
blocks are checked against the records.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.bench.measure import Spread, format_size, gbps, interleave, save_results, timed
from kvtier.bench.output import add_output_arguments
from kvtier.layout.geometry import KVLayout
from kvtier.ops.argtypes import positive_int

if TYPE_CHECKING:
    import torch

ORDERS = ("ascending", "descending", "scattered")
LAYOUTS = ("pages", "kv_first")
TOKENS, HEADS = 32, 4  # a kv_first block: 32 tokens of 4 heads (the head size follows from the page size)
TARGET = 0.8  # the scatter should reach this fraction of a plain copy's speed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=positive_int, default=8, help="layers of the group")
    parser.add_argument("--page-kib", type=positive_int, default=64, help="bytes of one block of one layer (KiB)")
    parser.add_argument("--chunks", type=positive_int, default=32, help="chunks loaded at once")
    parser.add_argument("--blocks-per-chunk", type=positive_int, default=2, help="blocks of one chunk")
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed rounds")
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: torch's own)")
    parser.add_argument("--layout", choices=LAYOUTS, default="pages",
                        help="the layers' layout: pages ([blocks, page], vLLM >= 0.32 on CPU) or kv_first ([2, "
                             "blocks, 32 tokens, 4 heads, head size], FlashAttention's on GPU)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (results copy-quick)")
    add_output_arguments(parser, "copy", chart=False)


def block_orders(chunks: int, bpc: int, num_blocks: int, seed: int = 5) -> dict[str, list[list[int]]]:
    """Each chunk's target blocks per order (ids 1..num_blocks-1; 0 is vLLM's null block)."""
    total = chunks * bpc
    fresh = list(range(1, total + 1))
    reused = list(range(num_blocks - 1, num_blocks - 1 - total, -1))
    scattered = random.Random(seed).sample(range(1, num_blocks), total)
    return {name: [ids[i * bpc:(i + 1) * bpc] for i in range(chunks)]
            for name, ids in zip(ORDERS, (fresh, reused, scattered), strict=True)}


def measure(layers_n: int, page_bytes: int, chunks: int, bpc: int, repeats: int,
            layout: str = "pages") -> dict[str, Any]:
    """Seconds of a plain copy and of the scatter per block order, interleaved; raises AssertionError when a
    scatter wrote other bytes than the records'."""
    import torch

    from kvtier.kvcopy.transfer import scatter

    page = page_bytes // 4
    num_blocks = 2 * chunks * bpc + 2
    kind = KVLayout(layout)
    head = page // (2 * TOKENS * HEADS)
    shape = (num_blocks, page) if kind is KVLayout.PAGES else (2, num_blocks, TOKENS, HEADS, head)
    chunk = (layers_n, bpc, page) if kind is KVLayout.PAGES else (layers_n, 2, bpc * TOKENS, HEADS, head)
    layers = [torch.zeros(shape) for _ in range(layers_n)]
    record = layers_n * bpc * page
    pool = torch.randn(chunks * record, generator=torch.Generator().manual_seed(3))
    payloads = [pool[i * record:(i + 1) * record].view(chunk) for i in range(chunks)]
    plain_src, plain_dst = pool.clone(), torch.zeros_like(pool)
    orders = block_orders(chunks, bpc, num_blocks)

    def scatter_timed(ids: list[list[int]]) -> Callable[[], float]:
        return lambda: timed(lambda: scatter(layers, ids, kind, payloads))

    runs: dict[str, Callable[[], float]] = {"plain_copy": lambda: timed(lambda: plain_dst.copy_(plain_src))}
    runs.update((name, scatter_timed(ids)) for name, ids in orders.items())
    samples = interleave(runs, repeats)
    for ids in orders.values():
        scatter(layers, ids, kind, payloads)
        for i, chunk_ids in enumerate(ids):
            for j, b in enumerate(chunk_ids):
                assert all(torch.equal(_block(t, b, kind), _part(payloads[i][li], j, kind))
                           for li, t in enumerate(layers)), "wrong KV"
    nbytes = chunks * record * 4
    plain = Spread.of(samples["plain_copy"]).median
    result: dict[str, Any] = {"bytes": nbytes, "plain_copy": _row(samples["plain_copy"], nbytes, plain)}
    for name in orders:
        result[name] = _row(samples[name], nbytes, plain)
    return result


def _block(layer: torch.Tensor, block: int, layout: KVLayout) -> torch.Tensor:
    """One block of one layer: its page, or its K and V rows (``[2, tokens, heads, head]``)."""
    return layer[block] if layout is KVLayout.PAGES else layer[:, block]


def _part(payload: torch.Tensor, j: int, layout: KVLayout) -> torch.Tensor:
    """Block ``j`` of one layer's part of a chunk's payload, shaped as ``_block`` gives it."""
    return payload[j] if layout is KVLayout.PAGES else payload[:, j * TOKENS:(j + 1) * TOKENS]


def _row(samples: list[float], nbytes: int, plain: float) -> dict[str, Any]:
    spread = Spread.of(samples)
    return {"seconds": spread.as_dict(), "gb_per_s": gbps(nbytes, spread.median),
            "speed_vs_plain_copy": plain / spread.median, "meets_target": plain / spread.median >= TARGET}


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: --help loads no torch

    if args.threads:
        torch.set_num_threads(args.threads)
    chunks, page_kib, repeats = (4, 16, 3) if args.quick else (args.chunks, args.page_kib, args.repeats)
    layers_n, bpc = (2, 2) if args.quick else (args.layers, args.blocks_per_chunk)
    result = measure(layers_n, page_kib << 10, chunks, bpc, repeats, args.layout)
    print(f"{format_size(result['bytes'])}, {chunks} chunks x {bpc} blocks x {layers_n} layers of {page_kib} KiB "
          f"blocks ({args.layout}), {torch.get_num_threads()} torch thread(s); target >= {TARGET}x a plain copy")
    print(f"{'copy':<12} {'median ms':>10} {'GB/s':>7} {'x plain':>8}")
    for name in ("plain_copy", *ORDERS):
        row = result[name]
        print(f"{name:<12} {row['seconds']['median'] * 1e3:10.2f} {row['gb_per_s']:7.2f} "
              f"{row['speed_vs_plain_copy']:8.2f}")
    settings = {"layers": layers_n, "page_bytes": page_kib << 10, "chunks": chunks, "blocks_per_chunk": bpc,
                "repeats": repeats, "torch_threads": torch.get_num_threads(), "dtype": "float32", "target": TARGET,
                "layout": args.layout}
    save_results(args, "copy" if args.layout == "pages" else f"copy_{args.layout}",
                 {"settings": settings, "results": result})
    return 0


def main() -> int:
    """``python -m kvtier.bench.copy`` (also ``kvtier bench copy``)."""
    from kvtier.bench.output import check_writable
    from kvtier.ops.cli import KvtierParser

    parser = KvtierParser(prog="python -m kvtier.bench.copy", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args()
    check_writable(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
