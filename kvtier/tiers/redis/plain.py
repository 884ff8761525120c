"""Redis tier operations through redis-py pipelines (standalone or cluster client alike).

Used for the small commands (EXISTS, DEL and the header probes deletes need) and, with ``rediss://`` (TLS),
for the records themselves. Records keep the layout of ``.bulk`` (head + parts), so TLS and plain clients
share one Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.errors import CorruptRecord
from kvtier.records import codec
from kvtier.tiers.redis.bulk import HEAD_PROBE, GetResult, length_from_probe, part_name, parts_of


async def pipeline(client: Any, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
    """Run ``(method, args)`` calls in one non-transactional pipeline; error replies come back as exceptions."""
    pipe = client.pipeline(transaction=False)
    for method, args in calls:
        getattr(pipe, method)(*args)
    return list(await pipe.execute(raise_on_error=False))


async def delete_records(client: Any, names: Sequence[bytes], totals: Sequence[int | None]) -> list[int]:
    """DEL each record's head and parts; per record 1 if its head existed. A record whose length is not known
    (``None``) is probed first (the start of its header says how many parts it has)."""
    unknown = [i for i, t in enumerate(totals) if t is None]
    lengths = list(totals)
    if unknown:
        probes = await pipeline(client, [("getrange", (names[i], 0, HEAD_PROBE - 1)) for i in unknown])
        for i, probe in zip(unknown, probes, strict=True):
            lengths[i] = length_from_probe(probe) if isinstance(probe, bytes) else None
    calls: list[tuple[str, tuple[Any, ...]]] = []
    heads: list[int] = []
    for name, total in zip(names, lengths, strict=True):
        heads.append(len(calls))
        calls += [("delete", (part_name(name, k),)) for k in range(len(parts_of(total)) if total else 1)]
    out = await pipeline(client, calls)
    return [_int(out[h]) for h in heads]


def _int(reply: Any) -> int:
    if isinstance(reply, Exception):
        raise reply
    return int(reply)


async def exists(client: Any, names: Sequence[bytes]) -> list[bool]:
    """Whether each record's head exists."""
    return [bool(_int(r)) for r in await pipeline(client, [("exists", (name,)) for name in names])]


async def get_records(client: Any, names: Sequence[bytes], keys: Sequence[bytes], *, max_raw: int,
                      hmac_key: bytes | None) -> GetResult:
    """GET the heads, then the other parts of the records found, then ``codec.decode`` each record."""
    heads = await pipeline(client, [("get", (name,)) for name in names])
    result = GetResult(values=[None] * len(names))
    wanted: list[tuple[int, int]] = []
    for i, head in enumerate(heads):
        if isinstance(head, Exception) and "WRONGTYPE" in str(head):
            result.corrupt.append(i)  # something else than a string under our prefix
        elif isinstance(head, Exception):
            result.errors.append(str(head))
        elif head is not None:
            try:
                header = codec.decode_header(head, expected_key=keys[i], max_raw=max_raw)
            except CorruptRecord:
                result.corrupt.append(i)
                continue
            if len(head) != header.total_len:  # split into parts (a whole record in one value is accepted too)
                wanted += [(i, k) for k in range(1, len(parts_of(header.total_len)))]
    parts = await pipeline(client, [("get", (part_name(names[i], k),)) for i, k in wanted]) if wanted else []
    pieces: dict[int, list[bytes]] = {}
    for (i, _), part in zip(wanted, parts, strict=True):
        pieces.setdefault(i, []).append(part if isinstance(part, bytes) else b"")
    for i, head in enumerate(heads):
        if isinstance(head, bytes) and i not in result.corrupt:
            result.values[i] = _decode(b"".join([head, *pieces.get(i, [])]), keys[i], max_raw, hmac_key)
            if result.values[i] is None:
                result.corrupt.append(i)
    return result


def _decode(record: bytes, key: bytes, max_raw: int, hmac_key: bytes | None) -> torch.Tensor | None:
    try:
        rec = codec.decode(record, expected_key=key, max_raw=max_raw, hmac_key=hmac_key)
    except CorruptRecord:
        return None
    tensor = torch.frombuffer(bytearray(rec.payload), dtype=getattr(torch, rec.header.dtype))
    return tensor.reshape(rec.header.shape)


async def put_records(client: Any, items: Sequence[tuple[bytes, list[Any]]], px_ms: int | None) -> list[str | None]:
    """SET each record's parts (others first, head last); per record None or its first error."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    spans: list[range] = []
    for name, buffers in items:
        record = b"".join(buffers)
        layout = parts_of(len(record))
        start = len(calls)
        for k in [*range(1, len(layout)), 0]:
            off, length = layout[k]
            calls.append(("set", (part_name(name, k), record[off:off + length], None, px_ms)))
        spans.append(range(start, len(calls)))
    out = await pipeline(client, calls)
    return [next((str(out[j]) for j in span if out[j] is not True), None) for span in spans]
