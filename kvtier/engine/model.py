"""A tiny decoder-only transformer whose attention reads K/V through block tables from a paged cache.

Every reduction runs on fixed shapes so that a token's result does not depend on what it is batched with:
matrix products go through :func:`tiled_matmul` (rows padded to tiles of ``TILE`` and multiplied with one
``bmm`` per tile), and attention visits keys in fixed blocks combined in order. This is what makes
"KV loaded from a tier" and "KV recomputed" bit-identical in float32: any difference is a real bug (a wrong
scatter, a wrong block, a stale chunk), never rounding noise from a different batch shape.

Layout of one layer's paged KV tensor: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V).
Layers listed in ``ModelConfig.recurrent_layers`` are gated linear attention instead (kvtier.engine.recurrent):
their state lives in one block of a ``uint8`` state cache, read and written per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.engine.recurrent import StateBatch, StateLayout, init_recurrent_weights, recurrent_mixer, reference_mixer
from kvtier.layout import dtype_name

TILE = 16  # rows per matrix-product tile; queries of one request are padded to a multiple of it
KEY_BLOCK = 128  # keys per attention block; a request's gathered keys span a multiple of it

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny model. ``sliding_window`` set: the layers in ``swa_layers`` (default: odd ones that are
    not recurrent) use it. ``recurrent_layers``: gated linear-attention layers (kvtier.engine.recurrent)."""

    vocab_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    intermediate_size: int = 128
    sliding_window: int | None = None
    swa_layers: tuple[int, ...] | None = None
    max_model_len: int = 1024
    positions: str = "rope"  # "rope" or "learned"
    rope_theta: float = 10000.0
    dtype: str = "float32"
    seed: int = 0
    recurrent_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.positions not in ("rope", "learned"):
            raise ValueError(f"positions must be 'rope' or 'learned', not {self.positions!r}")
        if dtype_name(self.dtype) not in _DTYPES:
            raise ValueError(f"dtype must be float32 or bfloat16, not {self.dtype!r}")
        recurrent = set(self.recurrent_layers)
        if len(recurrent) != len(self.recurrent_layers) or not recurrent <= set(range(self.num_layers)):
            raise ValueError(f"recurrent_layers must be distinct layer indices below {self.num_layers}")
        if recurrent & set(self.sliding_layers()):
            raise ValueError("a layer cannot be both recurrent and sliding-window")
        if len(recurrent) + len(self.sliding_layers()) >= self.num_layers:
            raise ValueError("the model needs at least one full-attention layer")

    @property
    def model(self) -> str:
        """A model id naming these weights (engines' ``model_config.model``; kvtier scopes keys by it)."""
        layers = ",".join(str(i) for i in self.sliding_layers())
        window = f"-swa{self.sliding_window}@{layers}" if self.sliding_window else ""
        rec = ",".join(str(i) for i in sorted(self.recurrent_layers))
        recurrent = f"-gla@{rec}" if rec else ""
        pos = f"rope{self.rope_theta:g}" if self.positions == "rope" else f"learned{self.max_model_len}"
        return (f"kvtier-tiny-l{self.num_layers}h{self.num_heads}kv{self.num_kv_heads}d{self.head_size}"
                f"v{self.vocab_size}i{self.intermediate_size}-{pos}{window}{recurrent}-seed{self.seed}")

    @property
    def weights_identity(self) -> str:
        """What identifies the weights (kvtier.records.fingerprint): they are generated from the shape and seed the
        model id names, so the id itself, with the dtype."""
        return f"{self.model}-{dtype_name(self.dtype)}"

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[dtype_name(self.dtype)]

    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers (empty without a window)."""
        if self.sliding_window is None:
            return ()
        if self.swa_layers is not None:
            return tuple(sorted(self.swa_layers))
        return tuple(i for i in range(self.num_layers) if i % 2 == 1 and i not in self.recurrent_layers)

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers() else None

    def is_recurrent(self, layer: int) -> bool:
        return layer in self.recurrent_layers

    def state_layout(self) -> StateLayout:
        """Shapes and cache row of one recurrent layer's state."""
        return StateLayout.of(self.hidden_size, self.num_heads, self.head_size)

    def layer_name(self, layer: int) -> str:
        """The layer's name (vLLM's style: ``self_attn`` for attention, ``linear_attn`` for recurrent layers)."""
        return f"model.layers.{layer}.{'linear_attn' if self.is_recurrent(layer) else 'self_attn'}"


@dataclass
class GroupAttention:
    """Per KV-cache group inputs: where each new token's K/V goes, and every key slot of each request."""

    write_slots: torch.Tensor  # [V] slot index (block * block_size + offset) of each valid row
    req_slots: torch.Tensor  # [N, L] slot of every key position of each request (L: multiple of KEY_BLOCK)


@dataclass
class BatchMeta:
    """A batch laid out in tiles: request ``r`` owns whole tiles, padded rows are marked invalid."""

    positions: torch.Tensor  # [Tp] position of each row (0 for padding)
    valid_rows: torch.Tensor  # [V] indices of the real rows
    tile_req: torch.Tensor  # [Tp / TILE] request of each tile
    ctx_lens: torch.Tensor  # [N] tokens in context after this step (computed + scheduled)
    sample_rows: torch.Tensor  # [S] rows whose next-token logits are wanted
    groups: list[GroupAttention] = field(default_factory=list)
    states: StateBatch | None = None  # recurrent layers: each request's running state block


class LayerHooks(Protocol):
    """Called by the model around each attention layer (the connector's per-layer worker hooks)."""

    def before_attention(self, layer: int) -> None: ...

    def after_attention(self, layer: int) -> None: ...


def tiled_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` with rows padded to ``TILE`` and one fixed-shape product per tile (batch-invariant)."""
    rows, k = x.shape
    pad = (-rows) % TILE
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    tiles = x.shape[0] // TILE
    out = torch.bmm(x.reshape(tiles, TILE, k), w.expand(tiles, *w.shape))
    return out.reshape(tiles * TILE, w.shape[1])[:rows]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Row-wise RMS normalisation (computed in float32)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (half-split convention) to ``[T, heads, head_size]`` with ``cos``/``sin`` ``[T, head_size/2]``."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class TinyTransformer:
    """Seeded random weights; greedy next-token logits over a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        self.weights = _init_weights(config, gen)
        half = config.head_size // 2
        inv = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.arange(config.max_model_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.weights["embed"][tokens]
        if self.config.positions == "learned":
            h = h + self.weights["pos_embed"][positions]
        return h

    def forward(self, tokens: torch.Tensor, meta: BatchMeta, kv_caches: list[torch.Tensor],
                group_of_layer: list[int], hooks: LayerHooks | None = None) -> torch.Tensor:
        """Run the batch, writing each layer's new K/V into its paged cache; logits of ``meta.sample_rows``."""
        h = self.embed(tokens, meta.positions)
        for i in range(self.config.num_layers):
            x = rms_norm(h, self.weights[f"{i}.ln1"])
            if self.config.is_recurrent(i):
                h = h + self._recurrent(i, x, meta, kv_caches[i])
            else:  # the connector's per-layer hooks wrap attention layers only, as in vLLM
                if hooks is not None:
                    hooks.before_attention(i)
                attn = self._attention(i, x, meta, kv_caches[i], meta.groups[group_of_layer[i]])
                if hooks is not None:
                    hooks.after_attention(i)
                h = h + attn
            h = h + self._mlp(i, rms_norm(h, self.weights[f"{i}.ln2"]))
        out = rms_norm(h[meta.sample_rows], self.weights["norm"])
        return tiled_matmul(out, self.weights["lm_head"]).float()

    def _recurrent(self, i: int, x: torch.Tensor, meta: BatchMeta, cache: torch.Tensor) -> torch.Tensor:
        if meta.states is None:
            raise ValueError("a batch for a model with recurrent layers needs its state blocks (BatchMeta.states)")
        return recurrent_mixer(self.weights, i, x, meta.states, cache, self.config.state_layout(),
                               self.config.num_heads, tiled_matmul)

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = tiled_matmul(x, self.weights[f"{i}.gate_up"]).chunk(2, dim=-1)
        return tiled_matmul(torch.nn.functional.silu(gate) * up, self.weights[f"{i}.down"])

    def _qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        qkv = tiled_matmul(x, self.weights[f"{i}.qkv"])
        q, k, v = qkv.split([c.num_heads * c.head_size, c.num_kv_heads * c.head_size,
                             c.num_kv_heads * c.head_size], dim=-1)
        q = q.reshape(-1, c.num_heads, c.head_size)
        k = k.reshape(-1, c.num_kv_heads, c.head_size)
        v = v.reshape(-1, c.num_kv_heads, c.head_size)
        if c.positions == "rope":
            cos, sin = self.cos[positions], self.sin[positions]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return q, k, v

    def _attention(self, i: int, x: torch.Tensor, meta: BatchMeta, cache: torch.Tensor,
                   group: GroupAttention) -> torch.Tensor:
        c = self.config
        q, k, v = self._qkv(i, x, meta.positions)
        flat = cache.view(2, -1, c.num_kv_heads, c.head_size)
        flat[0].index_copy_(0, group.write_slots, k[meta.valid_rows])
        flat[1].index_copy_(0, group.write_slots, v[meta.valid_rows])
        keys, values = flat[0][group.req_slots], flat[1][group.req_slots]  # [N, L, kvh, hd]
        key_pos = torch.arange(group.req_slots.shape[1])
        in_ctx = key_pos[None, :] < meta.ctx_lens[:, None]
        values = torch.where(in_ctx[:, :, None, None], values, torch.zeros((), dtype=values.dtype))
        out = paged_attention(q, keys, values, meta, c, c.window_of(i))
        return tiled_matmul(out, self.weights[f"{i}.o"])


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: BatchMeta,
                    c: ModelConfig, window: int | None) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention of tiled queries over each request's gathered keys.

    Keys are visited in fixed blocks of ``KEY_BLOCK`` and combined in order; a block no query of the batch can
    see adds exact zeros, so the result does not depend on how many blocks the batch spans.
    """
    tiles, kvh, group, hd = meta.tile_req.shape[0], c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_size
    qt = (q.float() * (1.0 / math.sqrt(hd))).reshape(tiles, TILE, kvh, group, hd)
    qt = qt.permute(0, 2, 3, 1, 4).reshape(tiles * kvh, group * TILE, hd)
    kt = keys[meta.tile_req].float().permute(0, 2, 3, 1).reshape(tiles * kvh, hd, -1)
    vt = values[meta.tile_req].float().permute(0, 2, 1, 3).reshape(tiles * kvh, -1, hd)
    qpos = meta.positions.view(tiles, 1, 1, TILE, 1)
    scores = []
    for start in range(0, kt.shape[-1], KEY_BLOCK):
        kpos = torch.arange(start, start + KEY_BLOCK).view(1, 1, 1, 1, -1)
        allowed = kpos <= qpos
        if window is not None:
            allowed = allowed & (kpos > qpos - window)
        block = torch.bmm(qt, kt[:, :, start:start + KEY_BLOCK].contiguous())
        scores.append(block.view(tiles, kvh, group, TILE, KEY_BLOCK).masked_fill(~allowed, float("-inf")))
    top = torch.stack([s.amax(dim=-1) for s in scores]).amax(dim=0, keepdim=True)[0].unsqueeze(-1)
    out = torch.zeros(tiles * kvh, group * TILE, hd)
    denom = torch.zeros(tiles, kvh, group, TILE, 1)
    for b, block in enumerate(scores):
        weights = torch.exp(block - top)
        denom = denom + weights.sum(dim=-1, keepdim=True)
        v = vt[:, b * KEY_BLOCK:(b + 1) * KEY_BLOCK].contiguous()
        out = out + torch.bmm(weights.view(tiles * kvh, group * TILE, KEY_BLOCK), v)
    out = (out.view(tiles, kvh, group, TILE, hd) / denom).permute(0, 3, 1, 2, 4)
    return out.reshape(tiles * TILE, c.num_heads * hd).to(q.dtype)


def _init_weights(c: ModelConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(c.torch_dtype)

    def ones(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(c.torch_dtype)

    d, kv = c.hidden_size, c.num_kv_heads * c.head_size
    w = {"embed": torch.randn(c.vocab_size, d, generator=gen).to(c.torch_dtype),
         "norm": ones(d), "lm_head": rand(d, c.vocab_size)}
    if c.positions == "learned":
        w["pos_embed"] = (0.5 * torch.randn(c.max_model_len, d, generator=gen)).to(c.torch_dtype)
    for i in range(c.num_layers):
        w[f"{i}.ln1"], w[f"{i}.ln2"] = ones(d), ones(d)
        if c.is_recurrent(i):
            w.update(init_recurrent_weights(i, d, c.num_heads, rand, gen))
        else:
            w[f"{i}.qkv"] = rand(d, d + 2 * kv)
            w[f"{i}.o"] = rand(d, d)
        w[f"{i}.gate_up"] = rand(d, 2 * c.intermediate_size)
        w[f"{i}.down"] = rand(c.intermediate_size, d)
    return w


def reference_logits(model: TinyTransformer, token_ids: list[int]) -> torch.Tensor:
    """Next-token logits ``[T, vocab]`` of a whole sequence with dense attention, no paging (test oracle)."""
    c, w = model.config, model.weights
    positions = torch.arange(len(token_ids))
    h = model.embed(torch.tensor(token_ids), positions).float()
    wf = {name: t.float() for name, t in w.items()}
    for i in range(c.num_layers):
        x = rms_norm(h, wf[f"{i}.ln1"])
        if c.is_recurrent(i):
            h = h + reference_mixer(wf, i, x, c.num_heads, c.state_layout())
        else:
            h = h + _dense_attention(model, wf, i, x, positions)
        gate, up = (rms_norm(h, wf[f"{i}.ln2"]) @ wf[f"{i}.gate_up"]).chunk(2, dim=-1)
        h = h + (torch.nn.functional.silu(gate) * up) @ wf[f"{i}.down"]
    return rms_norm(h, wf["norm"]) @ wf["lm_head"]


def _dense_attention(model: TinyTransformer, wf: dict[str, torch.Tensor], i: int, x: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Layer ``i``'s attention over the whole sequence (float32, no paging)."""
    c, n = model.config, x.shape[0]
    q, k, v = (x @ wf[f"{i}.qkv"]).split([c.hidden_size, c.num_kv_heads * c.head_size,
                                          c.num_kv_heads * c.head_size], dim=-1)
    q, k, v = (t.reshape(n, -1, c.head_size) for t in (q, k, v))
    if c.positions == "rope":
        cos, sin = model.cos[positions], model.sin[positions]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    rep = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_size)
    allowed = positions[None, :] <= positions[:, None]
    window = c.window_of(i)
    if window is not None:
        allowed &= positions[None, :] > positions[:, None] - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ wf[f"{i}.o"]
