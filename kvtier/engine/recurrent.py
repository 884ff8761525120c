"""Recurrent layers of the reference engine: a tiny gated linear attention whose state lives in a paged state cache.

One layer, for the rows of one request (its input ``x`` normalised as for attention):

    u = silu(causal depthwise conv of width CONV_WIDTH over x)      (conv state: the last CONV_WIDTH - 1 inputs)
    q, k, v, a = u W                                                (per head; ``a`` one gate logit per head)
    per token t:  S = g_t * S + k_t^T v_t,  o_t = q_t S             (g_t = sigmoid(a_t + GATE_BIAS) in (0, 1))
    out = o W_o

The state after a token, ``(conv state [CONV_WIDTH - 1, hidden], S [heads, head_size, head_size])`` in float32, is
everything needed to continue after it. It is held in one block of the layer's state cache, a ``uint8`` tensor
``[num_blocks, row_bytes]`` whose row ``b`` starts with the state's bytes (conv state, then S) and is padded to
``STATE_ALIGN`` bytes, as vLLM pads Mamba pages: the engine registers this tensor with the connector, which moves
``t.reshape(num_blocks, -1)[b, :state_bytes]``.

Batch and chunk invariance (what makes a loaded state give the logits of a recomputed one): projections go
through ``tiled_matmul`` on the batch's per-request tiles, the conv and the recurrence run per request and per
token with elementwise float32 operations of fixed shapes, and the state crosses a step boundary as exact bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

CONV_WIDTH = 4  # inputs the causal convolution sees (the conv state keeps CONV_WIDTH - 1 of them)
GATE_BIAS = 3.0  # gates start near sigmoid(3) = 0.95: a memory of a few dozen tokens
STATE_ALIGN = 512  # bytes a state cache row is padded to
STATE_DTYPE = torch.float32


@dataclass(frozen=True)
class StateLayout:
    """Shapes of one recurrent layer's state and where they lie in a state cache row."""

    conv: tuple[int, int]  # [CONV_WIDTH - 1, hidden]
    ssm: tuple[int, int, int]  # [heads, head_size, head_size]

    @classmethod
    def of(cls, hidden: int, heads: int, head_size: int) -> StateLayout:
        return cls((CONV_WIDTH - 1, hidden), (heads, head_size, head_size))

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.conv, self.ssm)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return ("float32", "float32")

    @property
    def state_bytes(self) -> int:
        """Bytes of one state (what ``MambaSpec.state_bytes_per_layer`` says)."""
        return (math.prod(self.conv) + math.prod(self.ssm)) * STATE_DTYPE.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one state cache row (the state, padded)."""
        return -(-self.state_bytes // STATE_ALIGN) * STATE_ALIGN

    def allocate(self, num_blocks: int) -> torch.Tensor:
        """A zeroed state cache: ``uint8 [num_blocks, row_bytes]``."""
        return torch.zeros(num_blocks, self.row_bytes, dtype=torch.uint8)

    def zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The state before the first token."""
        return torch.zeros(self.conv, dtype=STATE_DTYPE), torch.zeros(self.ssm, dtype=STATE_DTYPE)

    def _fields(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = cache[block, :self.state_bytes].view(STATE_DTYPE)
        split = math.prod(self.conv)
        return flat[:split].view(self.conv), flat[split:].view(self.ssm)

    def read(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the state held in ``block``."""
        conv, ssm = self._fields(cache, block)
        return conv.clone(), ssm.clone()

    def write(self, cache: torch.Tensor, block: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Store a state in ``block``."""
        dst_conv, dst_ssm = self._fields(cache, block)
        dst_conv.copy_(conv)
        dst_ssm.copy_(ssm)


@dataclass(frozen=True)
class StateBatch:
    """Per scheduled request, in batch order: its first row, its tokens this step, the block holding its
    running state, and whether it starts from the zero state (nothing computed before this step)."""

    first_rows: tuple[int, ...]
    lengths: tuple[int, ...]
    blocks: tuple[int, ...]
    fresh: tuple[bool, ...]


def init_recurrent_weights(i: int, hidden: int, heads: int, rand: Callable[..., torch.Tensor],
                           gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Weights of recurrent layer ``i`` (the caller's ``rand(*shape)`` draws scaled projections)."""
    conv = torch.randn(CONV_WIDTH, hidden, generator=gen) / math.sqrt(CONV_WIDTH)
    return {f"{i}.conv": conv, f"{i}.qkvg": rand(hidden, 3 * hidden + heads), f"{i}.o": rand(hidden, hidden)}


def causal_conv(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of ``x [n, hidden]`` after the inputs held in ``conv_state``; the output and
    the new conv state (one product and one sum per tap, in tap order: exact whatever ``n``)."""
    n = x.shape[0]
    xin = torch.cat([conv_state, x])
    out = xin[0:n] * weight[0]
    for j in range(1, weight.shape[0]):
        out = out + xin[j:j + n] * weight[j]
    return out, xin[n:].clone()


def scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, ssm: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated recurrence over ``n`` tokens (``q, k, v [n, heads, head]``, ``gate [n, heads]``) from ``ssm``;
    the outputs ``[n, heads, head]`` and the state after the last token."""
    out = torch.empty(q.shape, dtype=STATE_DTYPE)
    for t in range(q.shape[0]):
        ssm = ssm * gate[t][:, None, None] + k[t][:, :, None] * v[t][:, None, :]
        out[t] = (q[t][:, :, None] * ssm).sum(dim=1)
    return out, ssm


def gates_and_heads(proj: torch.Tensor, heads: int, head_size: int) -> tuple[torch.Tensor, ...]:
    """Split a ``[T, 3 * hidden + heads]`` projection into ``q, k, v [T, heads, head]`` (q and k scaled) and the
    gates ``[T, heads]``, all contiguous float32."""
    hidden = heads * head_size
    q, k, v, logits = proj.float().split([hidden, hidden, hidden, heads], dim=-1)
    scale = 1.0 / math.sqrt(head_size)
    shaped = [(t.contiguous() * s).reshape(-1, heads, head_size) for t, s in ((q, scale), (k, scale), (v, 1.0))]
    return (*shaped, torch.sigmoid(logits.contiguous() + GATE_BIAS))


def recurrent_mixer(weights: dict[str, torch.Tensor], i: int, x: torch.Tensor, batch: StateBatch,
                    cache: torch.Tensor, layout: StateLayout, heads: int,
                    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Layer ``i`` over a tiled batch ``x [Tp, hidden]``: reads each request's running state from its block,
    writes the state after its last token back there; the layer's output ``[Tp, hidden]``."""
    head_size = x.shape[1] // heads
    xf, conv_w = x.float(), weights[f"{i}.conv"].float()
    mixed = torch.zeros_like(xf)
    states: list[tuple[torch.Tensor, torch.Tensor]] = []
    for first, n, block, fresh in zip(batch.first_rows, batch.lengths, batch.blocks, batch.fresh, strict=True):
        conv, ssm = layout.zeros() if fresh else layout.read(cache, block)
        mixed[first:first + n], conv = causal_conv(conv, xf[first:first + n], conv_w)
        states.append((conv, ssm))
    proj = matmul(torch.nn.functional.silu(mixed).to(x.dtype), weights[f"{i}.qkvg"])
    q, k, v, gate = gates_and_heads(proj, heads, head_size)
    out = torch.zeros(q.shape, dtype=STATE_DTYPE)
    for first, n, block, (conv, ssm) in zip(batch.first_rows, batch.lengths, batch.blocks, states, strict=True):
        rows = slice(first, first + n)
        out[rows], ssm = scan(q[rows], k[rows], v[rows], gate[rows], ssm)
        layout.write(cache, block, conv, ssm)
    return matmul(out.reshape(x.shape[0], -1).to(x.dtype), weights[f"{i}.o"])


def reference_mixer(weights: dict[str, torch.Tensor], i: int, x: torch.Tensor, heads: int,
                    layout: StateLayout) -> torch.Tensor:
    """Layer ``i`` over a whole sequence ``x [T, hidden]`` from the zero state, without paging (test oracle)."""
    conv, ssm = layout.zeros()
    mixed, _ = causal_conv(conv, x.float(), weights[f"{i}.conv"].float())
    proj = torch.nn.functional.silu(mixed) @ weights[f"{i}.qkvg"].float()
    q, k, v, gate = gates_and_heads(proj, heads, x.shape[1] // heads)
    out, _ = scan(q, k, v, gate, ssm)
    return out.reshape(x.shape[0], -1) @ weights[f"{i}.o"].float()
