"""Weight-only layers compute what their dequantized weights say, int4 holds a 4-bit grid as it is,
and what the kernels cannot run is refused before any weight is touched."""

import pytest
import torch
from torch import nn

from backends.errors import ModelLoadError
from backends.weight_only import (
    GROUP,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    check_weight_only,
    on_int4_grid,
    replace_linears,
)


def linear(n: int = 64, k: int = 96, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def on_grid(layer: nn.Linear) -> nn.Linear:
    """The layer's weights snapped to a Q4_1-style grid: per 32 inputs, low + q·(high − low)/15."""
    with torch.no_grad():
        n, k = layer.weight.shape
        groups = layer.weight.reshape(n, k // GROUP, GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        step = (high - low) / 15
        layer.weight.copy_((low + torch.round((groups - low) / step) * step).reshape(n, k))
    return layer


@pytest.mark.parametrize("layer_type", [Int8WeightOnlyLinear, Int4WeightOnlyLinear])
def test_a_layer_matches_its_float_original_to_the_kernels_rounding(layer_type):
    original = on_grid(linear(bias=True))
    layer = layer_type(original)
    x = torch.randn(3, 5, original.in_features)
    got, want = layer(x), original(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    # bfloat16 inputs and outputs: ~3 significant digits; the weights add their own rounding.
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert layer.max_weight_error < 0.02 * original.weight.abs().max()


def test_int4_holds_a_4bit_grid_up_to_the_bfloat16_of_its_scales():
    original = on_grid(linear())
    int4, int8 = Int4WeightOnlyLinear(original), Int8WeightOnlyLinear(original)
    w = original.weight.detach()
    groups = w.reshape(w.shape[0], -1, GROUP)
    step = float(((groups.amax(-1) - groups.amin(-1)) / 15).min())  # the finest group's step
    assert int4.max_weight_error < 0.05 * step  # off the grid only by bfloat16 scale/zero rounding
    assert int8.max_weight_error > int4.max_weight_error  # int8 per channel cannot hold 32-wide groups


def test_the_grid_detector_tells_a_4bit_checkpoint_from_float_weights():
    assert on_int4_grid({"a": on_grid(linear())})
    assert not on_int4_grid({"a": linear()})
    assert not on_int4_grid({"a": nn.Linear(40, 8)})  # inputs not in groups of 32


def test_replace_linears_swaps_every_layer_but_the_skipped():
    model = nn.Sequential()
    model.add_module("proj", linear())
    model.add_module("lm_head", linear(k=64))
    made = replace_linears(model, "int8-weight-only", skip={"lm_head"})
    assert len(made) == 1 and isinstance(model.proj, Int8WeightOnlyLinear)
    assert isinstance(model.lm_head, nn.Linear)


def test_what_the_kernels_cannot_run_is_refused_with_what_to_do():
    layers = {"proj": linear()}
    with pytest.raises(ModelLoadError, match="device cpu"):
        check_weight_only("int8-weight-only", "cuda", layers)
    with pytest.raises(ModelLoadError, match="groups of 32.*use int8-weight-only"):
        check_weight_only("int4-weight-only", "cpu", {"odd": nn.Linear(40, 8)})
    check_weight_only("int4-weight-only", "cpu", layers)  # fits: no error
