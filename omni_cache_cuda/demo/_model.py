"""A small causal decoder-only transformer that reads and writes a paged KV cache.

The model stands in for the "thinker" of a multi-stage pipeline. It is deliberately tiny (random
weights from a fixed seed, nothing downloaded) but it has the one property the demo needs: its
forward runs over a flat batch of scheduled tokens from several requests, each token writes its
K/V into its KV slot (``slot = block_id * block_size + offset``) and attends over its request's
earlier positions read back through the request's block table. A prefix whose KV blocks are
cached is therefore really skipped, exactly as in a vLLM-style engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from attrs import field, frozen
from attrs.validators import ge, gt
from torch import nn
from torch.nn import functional as F

__all__ = ["ModelConfig", "PagedKVCache", "SeqSlice", "TinyCausalLM"]


@frozen(kw_only=True)
class ModelConfig:
    """Shape and seed of the demo model.

    Attributes:
        vocab_size: Number of token ids.
        d_model: Width of the residual stream, and of the last hidden state.
        num_layers: Number of decoder layers.
        num_heads: Attention heads per layer; must divide ``d_model``.
        max_positions: Length of the learned position table (longest request).
        talker_width: Width of the per-token ``talker.h`` projection.
        seed: Seed of the weight initialisation.
    """

    vocab_size: int = field(default=512, validator=gt(1))
    d_model: int = field(default=128, validator=gt(0))
    num_layers: int = field(default=2, validator=gt(0))
    num_heads: int = field(default=4, validator=gt(0))
    max_positions: int = field(default=1024, validator=gt(0))
    talker_width: int = field(default=16, validator=gt(0))
    seed: int = field(default=0, validator=ge(0))

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.num_heads


@frozen(kw_only=True)
class SeqSlice:
    """One request's share of a flat batch.

    Attributes:
        row_start: First row of the request in the batch.
        row_end: One past its last row.
        context_len: Tokens in the request's KV after this step (computed before plus scheduled).
        context_slots: KV slot of every position ``0 .. context_len - 1``, on the model's device.
    """

    row_start: int
    row_end: int
    context_len: int
    context_slots: torch.Tensor

    @property
    def num_rows(self) -> int:
        """Number of tokens scheduled for the request in this step."""
        return self.row_end - self.row_start


class PagedKVCache:
    """Per-layer K and V tensors of shape ``(num_blocks, block_size, heads, head_dim)``."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """Allocate the cache filled with NaN.

        NaN rather than zeros: a read of a slot that no request wrote in its current tenancy turns
        the whole attention output into NaN, so a bookkeeping bug in the engine cannot hide.

        Args:
            config: The model the cache serves.
            num_blocks: Number of KV blocks.
            block_size: Tokens per block.
            device: Where the cache lives.
        """
        shape = (num_blocks, block_size, config.num_heads, config.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = [torch.full(shape, math.nan, device=device) for _ in range(config.num_layers)]
        self.values = [torch.full(shape, math.nan, device=device) for _ in range(config.num_layers)]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the layer's K and V viewed as ``(num_slots, heads, head_dim)``."""
        k, v = self.keys[layer], self.values[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])


class _Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.heads = config.num_heads
        self.head_dim = config.head_dim
        self.ln_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln_mlp = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(
        self,
        x: torch.Tensor,
        slot_mapping: torch.Tensor,
        seqs: Sequence[SeqSlice],
        kv_flat: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.ln_attn(x)).view(n, 3, self.heads, self.head_dim).unbind(1)
        k_flat, v_flat = kv_flat
        # Every scheduled token writes its K/V before any token attends. A request that hits a
        # block another request of this same step is computing (the engine registers block hashes
        # at scheduling time, as vLLM does) therefore reads that step's fresh K/V.
        k_flat[slot_mapping] = k
        v_flat[slot_mapping] = v
        attn = torch.empty_like(q)
        for seq in seqs:
            rows = slice(seq.row_start, seq.row_end)
            keys = k_flat[seq.context_slots].transpose(0, 1)  # (heads, ctx, head_dim)
            values = v_flat[seq.context_slots].transpose(0, 1)
            queries = q[rows].transpose(0, 1)  # (heads, n, head_dim)
            first_pos = seq.context_len - seq.num_rows
            if seq.num_rows == 1:
                # A decode token sees its whole context.
                mask = None
            else:
                query_pos = torch.arange(first_pos, seq.context_len, device=x.device)
                key_pos = torch.arange(seq.context_len, device=x.device)
                mask = key_pos[None, :] <= query_pos[:, None]
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
            attn[rows] = o.transpose(0, 1)
        h: torch.Tensor = x + self.out(attn.reshape(n, -1))
        mlp: torch.Tensor = self.down(F.gelu(self.up(self.ln_mlp(h))))
        return h + mlp


class TinyCausalLM(nn.Module):
    """Decoder-only transformer with learned positions, a greedy LM head and a talker projection."""

    def __init__(self, config: ModelConfig) -> None:
        """Build the model with deterministic random weights drawn from ``config.seed``.

        Args:
            config: Shape and seed.
        """
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.pos = nn.Embedding(config.max_positions, d)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self.ln_final = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.talker_proj = nn.Linear(d, config.talker_width)
        self._init_weights()
        self.eval()
        self.requires_grad_(False)

    def _init_weights(self) -> None:
        # The weights come from a private generator so that building a model never depends on,
        # or disturbs, torch's global random state.
        gen = torch.Generator().manual_seed(self.config.seed)
        for name, param in sorted(self.named_parameters()):
            if ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(param) if name.endswith("weight") else nn.init.zeros_(param)
            elif name.endswith("bias"):
                nn.init.normal_(param, std=0.02, generator=gen)
            elif param.ndim == 2 and name.split(".")[0] in {"embed", "pos"}:
                nn.init.normal_(param, std=1.0, generator=gen)
            else:
                nn.init.normal_(param, std=1.0 / math.sqrt(param.shape[1]), generator=gen)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seqs: Sequence[SeqSlice],
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Run the scheduled tokens of a batch and return their last hidden states.

        Args:
            input_ids: ``(num_tokens,)`` token ids, requests back to back in batch order.
            positions: ``(num_tokens,)`` position of each token in its request.
            slot_mapping: ``(num_tokens,)`` KV slot each token's K/V is written to.
            seqs: Each request's row range, context length and context slots, in batch order.
            kv_cache: The paged KV cache, read and written in place.

        Returns:
            ``(num_tokens, d_model)`` float32 hidden states, one row per scheduled token.
        """
        x = self.embed(input_ids) + self.pos(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, slot_mapping, seqs, kv_cache.flat(i))
        hidden: torch.Tensor = self.ln_final(x)
        return hidden

    @torch.inference_mode()
    def greedy(self, hidden_rows: torch.Tensor) -> list[int]:
        """Return the argmax next token for each hidden row."""
        tokens: list[int] = self.lm_head(hidden_rows).argmax(dim=-1).tolist()
        return tokens

    @torch.inference_mode()
    def talker_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden rows to the per-token ``talker.h`` tensor."""
        features: torch.Tensor = self.talker_proj(hidden)
        return features
