"""Packed linear layers compute what torch's linear computes, fused siblings included; a row's
bfloat16 result does not depend on the rows beside it (what width-invariant passes rest on);
weights changed in place, deep copies and gradients are served correctly."""

import copy

import pytest
import torch
from torch import nn

from backends import packing
from backends.packing import is_packed, pack_linears, packing_available, unpack_linears

from .conftest import tiny_model

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


def model_in(dtype: torch.dtype) -> nn.Module:
    return tiny_model(vocab_size=128, seed=0).to(dtype)


NO_BF16_PACKING = pytest.mark.skipif(
    not packing_available(torch.bfloat16),
    reason="this CPU has no oneDNN bfloat16 linear kernels (they need AVX-512 BW/VL/DQ or AVX-NE-CONVERT)",
)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NO_BF16_PACKING)])
def test_a_packed_model_computes_what_torch_computes(dtype):
    model = model_in(dtype)
    tokens = torch.randint(0, 128, (2, 7))
    want = model(input_ids=tokens).logits
    assert pack_linears(model) == 2 * 7 + 1  # seven projections a block, the LM head
    got = model(input_ids=tokens).logits
    packed = model.lm_head._group.packed.weight
    assert pack_linears(model) == 0 and model.lm_head._group.packed.weight is packed  # packed once
    # Same products, other kernels: float32 agrees to rounding; bfloat16 rounds every product.
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    torch.testing.assert_close(got, want, **tolerance)
    unpack_linears(model)
    assert not is_packed(model)
    torch.testing.assert_close(model(input_ids=tokens).logits, want, rtol=0, atol=0)


@torch.inference_mode()
def test_siblings_that_read_one_input_are_computed_in_one_product_in_any_order(monkeypatch):
    model = model_in(torch.float32)
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 3, 32)
    want = [attention.v_proj(x), attention.q_proj(x), attention.k_proj(x)]
    pack_linears(model)
    calls = []
    product = packing._product
    monkeypatch.setattr(packing, "_product", lambda x, w, b: calls.append(w.shape) or product(x, w, b))
    got = [attention.v_proj(x), attention.q_proj(x), attention.k_proj(x)]
    assert len(calls) == 1 and calls[0][0] == 32 + 16 + 16  # q (4 heads × 8) + k, v (2 heads × 8)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # Another input is computed afresh, not served from the last one's outputs.
    y = torch.randn(1, 3, 32)
    torch.testing.assert_close(attention.k_proj(y), nn.functional.linear(y, attention.k_proj.weight))


@torch.inference_mode()
def test_a_dtype_this_cpu_cannot_pack_keeps_torchs_linear(monkeypatch):
    monkeypatch.setattr(packing, "_packs", lambda dtype: dtype != torch.bfloat16)
    model = model_in(torch.bfloat16)
    assert pack_linears(model) == 0 and not is_packed(model)
    assert pack_linears(model_in(torch.float32)) == 2 * 7 + 1


@NO_BF16_PACKING
@torch.inference_mode()
def test_a_bfloat16_row_is_the_same_bits_whatever_rows_share_its_product():
    model = model_in(torch.bfloat16)
    pack_linears(model)
    mlp = model.model.layers[1].mlp
    rows = torch.randn(1, 16, 32, dtype=torch.bfloat16)
    alone = torch.cat([mlp(rows[:, i : i + 1]) for i in range(16)], dim=1)
    assert torch.equal(mlp(rows), alone)


def test_weights_changed_in_place_and_deep_copies_use_their_own_weights():
    model = model_in(torch.float32)
    pack_linears(model)
    layer = model.lm_head
    x = torch.randn(2, 32)
    with torch.inference_mode():
        before = layer(x)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(clone.lm_head(x), before, rtol=1e-5, atol=1e-5)
    assert is_packed(clone)


def test_a_pass_that_records_gradients_takes_torchs_linear():
    model = model_in(torch.float32)
    pack_linears(model)
    x = torch.randn(2, 32, requires_grad=True)
    out = model.lm_head(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, model.lm_head.weight.sum(0).expand(2, 32))
