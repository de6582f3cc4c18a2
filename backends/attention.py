"""Grouped-query attention without copying keys: the attention function the target runs on CPUs.

transformers' SDPA path repeats every key and value head for the query heads that share it
(`repeat_kv`) whenever a pass has more than one new position and a mask — every verification
pass, every width-invariant tile, every batch the paged cache runs — which copies the whole
gathered context once more per layer. Here the query heads that share a key/value head are laid
out as extra query rows of that head instead (the same move transformers makes for a single new
position), so attention reads each key once. A pass without a mask, or without grouping, is
transformers' own SDPA unchanged.
"""

from __future__ import annotations

import torch
from torch.nn import functional
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "specroute_grouped_sdpa"


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """(B, heads, W, D) queries over (B, kv heads, T, D) keys → (B, W, heads, D), as transformers'
    attention functions return it."""
    batch, heads, width, dim = query.shape
    groups = heads // key.shape[1]
    shared_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    plain = groups == 1 or width == 1 or not shared_mask or dropout or kwargs.get("position_bias") is not None
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # Head h = kv head h // groups: its rows follow its group's earlier heads' rows.
    rows = query.reshape(batch, key.shape[1], groups * width, dim)
    mask = attention_mask.expand(batch, -1, width, -1).repeat(1, 1, groups, 1)  # type: ignore[union-attr]
    out = functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, width, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # masks are made as for SDPA


def use_grouped_attention(model: PreTrainedModel) -> bool:
    """Run `model`'s SDPA attention as `grouped_sdpa` (models on another attention implementation
    keep theirs); whether it now does."""
    config = model.config
    if getattr(config, "_attn_implementation", None) == "sdpa":
        config._attn_implementation = GROUPED_SDPA
    return getattr(config, "_attn_implementation", None) == GROUPED_SDPA
