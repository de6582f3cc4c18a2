"""Grouped-query attention laid out as extra query rows computes what transformers' SDPA with
repeated key heads computes, and leaves the cases it does not handle to transformers."""

import pytest
import torch

from backends.attention import GROUPED_SDPA, grouped_sdpa, use_grouped_attention
from backends.kv import PagedCache

from .conftest import tiny_model


class Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True
    training = False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_rows_match_repeated_key_heads(dtype):
    torch.manual_seed(0)
    batch, kv_heads, width, columns, dim = 2, 2, 5, 40, 16
    query = torch.randn(batch, 3 * kv_heads, width, dim, dtype=dtype)
    key, value = (torch.randn(batch, kv_heads, columns, dim, dtype=dtype) for _ in range(2))
    mask = torch.rand(batch, 1, width, columns) < 0.7
    mask[..., 0] = True
    got, _ = grouped_sdpa(Attention(), query, key, value, mask, scaling=0.25)
    repeated = [t.repeat_interleave(3, dim=1) for t in (key, value)]
    want = torch.nn.functional.scaled_dot_product_attention(query, *repeated, attn_mask=mask, scale=0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=tolerance, atol=tolerance)


@torch.inference_mode()
def test_a_model_on_grouped_attention_decodes_what_it_did_on_sdpa():
    model = tiny_model(vocab_size=128, seed=0)
    model.config._attn_implementation = "sdpa"
    blocks = [[5, 9, 2, 7], [3, 3]]

    def logits() -> torch.Tensor:
        cache = PagedCache(model, 64)
        seqs = [cache.add(), cache.add()]
        return cache.logits(seqs, blocks)

    want = logits()
    assert use_grouped_attention(model) and model.config._attn_implementation == GROUPED_SDPA
    torch.testing.assert_close(logits(), want, rtol=1e-5, atol=1e-5)
    tokens = torch.tensor([[5, 9, 2, 7]])
    torch.testing.assert_close(model(input_ids=tokens).logits[0], want[0], rtol=1e-5, atol=1e-5)


def test_other_attention_implementations_are_left_alone():
    model = tiny_model(vocab_size=128, seed=0)
    model.config._attn_implementation = "eager"
    assert not use_grouped_attention(model)
    assert model.config._attn_implementation == "eager"
