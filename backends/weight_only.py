"""Weight-only quantized linear layers: int8 per output channel, int4 in groups of 32.

Only the weights are quantized; they are expanded inside a fused kernel, so a decode step reads
a quarter (int8) or an eighth (int4) of float32's bytes of weights. torch ships both CPU kernels:
`torch._weight_int8pack_mm` (symmetric int8, one scale per output channel) and
`aten._weight_int4pack_mm_for_cpu` (asymmetric int4, a scale and an offset per group of 32 inputs).

Their fast paths take bfloat16 activations; a float32 input falls to a scalar loop (measured here
on the embedded model: int8 6.7 tokens/s at batch 1 against 20 with bfloat16 inputs and 16 for
the float32 model). So each layer rounds its input to bfloat16 for the kernel and returns float32:
norms, attention, residuals and the LM head stay float32. What that costs in quality is measured
with the rest (`backends.quantized.measure_quality`), never assumed.

The int4 layout is the one GGUF's Q4_1 uses: per block of 32 weights w = d·q + m, q in 0..15. The
kernel computes (q − 8)·scale + zero, so scale = d and zero = m + 8·d hold a Q4_1 block exactly;
recovering d and m from a block's min and max is exact when the block's extremes are q = 0 and 15,
which Q4_1's encoder guarantees. `max_weight_error` reports how close any other weights come.
"""

from __future__ import annotations

import torch
from torch import nn

from policies.quantization import WeightOnlyMethod

from .errors import ModelLoadError

GROUP = 32  # int4 group size: GGUF's Q4_0/Q4_1 block
_KERNEL_DTYPE = torch.bfloat16
_KERNELS: dict[str, tuple[str, ...]] = {
    "int8-weight-only": ("aten::_weight_int8pack_mm",),
    "int4-weight-only": ("aten::_weight_int4pack_mm_for_cpu", "aten::_convert_weight_to_int4pack_for_cpu"),
}


class WeightOnlyLinear(nn.Module):
    """Shared shell: flatten to rows, run the kernel on bfloat16 rows, return the input's dtype."""

    in_features: int
    out_features: int
    max_weight_error: float  # the largest |w − dequantized w| over the layer

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(_KERNEL_DTYPE)
        y = self.matmul(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8WeightOnlyLinear(WeightOnlyLinear):
    """Symmetric int8 weights, one scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        w = linear.weight.detach().float()
        # The kernel takes bfloat16 scales: round the scale first, then the weights to that grid.
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12).to(_KERNEL_DTYPE)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127)
        self.register_buffer("qweight", q.to(torch.int8))
        self.register_buffer("scales", scale)
        dequantized = self.qweight.float() * self.scales.float()[:, None]
        self.max_weight_error = float((dequantized - w).abs().max())

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.qweight, self.scales)


class Int4WeightOnlyLinear(WeightOnlyLinear):
    """Asymmetric int4 weights in groups of 32 inputs, each with a scale and an offset."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.reshape(n, k // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        # The kernel takes its scales and zeros in bfloat16 (it refuses float32), so the zero
        # m + 8·d is rounded: the one place int4 departs from a Q4_1 block as stored.
        sz = torch.stack([scale.T, (low + 8 * scale).T], -1).to(_KERNEL_DTYPE).contiguous()
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k), 1))
        s, z = sz.float().unbind(-1)  # [k / GROUP, n] each
        dequantized = (q.float() - 8) * s.T[..., None] + z.T[..., None]
        self.max_weight_error = float((dequantized.reshape(n, k) - w).abs().max())

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, GROUP, self.scales_and_zeros)


LAYERS: dict[str, type[WeightOnlyLinear]] = {
    "int8-weight-only": Int8WeightOnlyLinear,
    "int4-weight-only": Int4WeightOnlyLinear,
}


def check_weight_only(method: WeightOnlyMethod, device: str, linears: dict[str, nn.Linear]) -> None:
    """Refuse at start-up what the kernels cannot run: another device, an unfit layer shape."""
    backend = "CUDA" if device.startswith("cuda") else device.upper()
    missing = [op for op in _KERNELS[method] if not torch._C._dispatch_has_kernel_for_dispatch_key(op, backend)]
    if device != "cpu" or missing:
        raise ModelLoadError(
            f"{method} runs torch's CPU kernel ({', '.join(_KERNELS[method])}); it is not available on "
            f"{device}: serve the quantized backend with device cpu"
        )
    if method == "int4-weight-only":
        unfit = [name for name, layer in linears.items() if layer.in_features % GROUP or layer.out_features % 8]
        if unfit:
            raise ModelLoadError(
                f"int4-weight-only needs every linear layer's inputs in groups of {GROUP} and outputs in "
                f"multiples of 8 ({unfit[0]} is {tuple(linears[unfit[0]].weight.shape)}): use int8-weight-only"
            )


@torch.no_grad()
def on_int4_grid(linears: dict[str, nn.Linear], tolerance: float = 1e-3) -> bool:
    """Whether every layer's weights are, per group of 32 inputs, min + q·(max − min)/15 for integer
    q, each within `tolerance` of a step (float32 rounding): a 4-bit checkpoint's weights."""
    for layer in linears.values():
        n, k = layer.weight.shape
        if k % GROUP:
            return False
        groups = layer.weight.detach().float().reshape(n, k // GROUP, GROUP)
        low = groups.amin(-1, keepdim=True)
        span = groups.amax(-1, keepdim=True) - low
        steps = (groups - low) / span.clamp(min=1e-12) * 15
        if float((steps - steps.round()).abs().max()) > tolerance:
            return False
    return True


def replace_linears(model: nn.Module, method: WeightOnlyMethod, skip: set[str]) -> list[WeightOnlyLinear]:
    """Swap every nn.Linear whose attribute name is not in `skip` for its weight-only layer, in place."""
    layer = LAYERS[method]
    made: list[WeightOnlyLinear] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name not in skip:
                made.append(layer(child))
                setattr(parent, name, made[-1])
    return made
