"""Prepacked, fused matrix kernels for linear layers on the CPU: the decode step's weights in the
layout oneDNN's kernels read fastest, and the projections that read one input in one product.

A batch-1 decode step is a chain of matrix-vector products, one per linear layer, so its speed is
how fast those products stream weights from memory. torch's default CPU linear (MKL's GEMM for
float32; oneDNN with a weight reorder on every call for bfloat16) reaches ~11 GB/s on a 1-row
product here, about a third of the copy bandwidth. oneDNN's linear over a weight reordered once
into its blocked layout reaches ~20 GB/s in float32 and ~25 GB/s in bfloat16 on the same
matrices, but each call costs ~20 µs whatever its size, and a Llama block makes seven (q, k, v,
o, gate, up, down). Layers that read the same input (q, k and v; gate and up) are therefore
packed as one matrix: the first of them called on an input computes all their outputs in one
product and the others take theirs, four calls a block instead of seven, each over a larger
matrix (`specroute bench plain` times packed against torch's own linear in one run).

The packed copy lives beside the original weights, which everything else (quantization,
fingerprints, drafters that share the target's layers) keeps reading; it costs the weights'
memory once more, made on a layer's first call. Only plain `nn.Linear` instances are packed, by
giving each its own forward; layers whose weights change in place (smoothing's folding,
training) repack on their next call, a deep copy starts without packed copies, and inputs the
packed kernel does not serve (another device or dtype, a pass that records gradients) take
torch's own linear.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional

# Sibling layers of one block that read the same input (transformers' Llama-family names).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class _Packed:
    """One packed matrix (the members' weights stacked) and what it was made from; a deep copy
    starts empty and packs its own weights on first use."""

    def __init__(self) -> None:
        self.source: list[tuple[int, int, torch.dtype]] = []
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> _Packed:
        return _Packed()

    def of(self, layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
        tensors = [m.weight for m in layers] + [m.bias for m in layers if m.bias is not None]
        source = [(t.data_ptr(), _version(t), t.dtype) for t in tensors]
        if self.weight is None or self.source != source:
            weight = torch.cat([m.weight.detach() for m in layers]) if len(layers) > 1 else layers[0].weight.detach()
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            biases = [m.bias.detach() for m in layers if m.bias is not None]
            self.bias = torch.cat(biases) if biases else None
            self.source = source
        return self.weight, self.bias


class _Group:
    """Linear layers that read one input: whichever is called first computes every member's
    output in one product; the others take theirs while the input is the same tensor object."""

    def __init__(self, members: Sequence[nn.Linear]):
        self.members = list(members)
        self.packed = _Packed()
        self.input: torch.Tensor | None = None
        self.waiting: dict[int, torch.Tensor] = {}

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.input is x and index in self.waiting:
            out = self.waiting.pop(index)
            if not self.waiting:
                self.input = None
            return out
        weight, bias = self.packed.of(self.members)
        outputs = _product(x, weight, bias).split([m.out_features for m in self.members], dim=-1)
        self.waiting = {i: out for i, out in enumerate(outputs) if i != index}
        self.input = x if self.waiting else None  # a lone layer keeps no reference to its input
        return outputs[index]


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear kernels in `dtype`: the bfloat16
    kernels need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, which an AVX2-only CPU lacks."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype in PACKED_DTYPES and _packs(dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    # oneDNN says which of its kernels this CPU runs only by refusing to reorder a weight.
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(2, 2, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module) -> int:
    """Serve every plain linear layer of `model` from a prepacked weight, siblings that read one
    input from one product; how many layers were newly packed (already packed ones stay as they are)."""
    if not packing_available():
        return 0  # a model in a dtype this CPU cannot pack keeps torch's linear (see _packable)
    grouped: set[int] = set()
    for parent in model.modules():
        for names in FUSED_GROUPS:
            members = [parent._modules.get(name) for name in names]
            if _fusable(members):
                group = _Group(members)  # type: ignore[arg-type]
                for index, member in enumerate(members):
                    _install(member, group, index)  # type: ignore[arg-type]
                    grouped.add(id(member))
    packed = len(grouped)
    for module in model.modules():
        if _packable(module) and id(module) not in grouped:
            _install(module, _Group([module]), 0)  # type: ignore[list-item, arg-type]
            packed += 1
    return packed


def unpack_linears(model: nn.Module) -> None:
    """Back to torch's own linear for every layer (the packed copies are freed)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("_group"), _Group):
            del module._group, module._group_index, module.forward


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m.__dict__.get("_group"), _Group) for m in model.modules())


def _packable(module: object) -> bool:
    """A plain float linear layer on the CPU, not packed yet (packing twice would throw away the
    packed copies already made)."""
    return (
        type(module) is nn.Linear
        and "_group" not in module.__dict__
        and packing_available(module.weight.dtype)
        and module.weight.device.type == "cpu"
    )


def _fusable(members: list[object]) -> bool:
    if not all(_packable(m) for m in members):
        return False
    first = members[0]
    return all(
        m.in_features == first.in_features  # type: ignore[union-attr]
        and m.weight.dtype == first.weight.dtype  # type: ignore[union-attr]
        and (m.bias is None) == (first.bias is None)  # type: ignore[union-attr]
        for m in members
    )


def _install(module: nn.Linear, group: _Group, index: int) -> None:
    # The forward reads its group from the module at call time, so a deep copy of the model
    # (whose modules get copied groups) computes with its own weights.
    module._group, module._group_index = group, index
    module.forward = types.MethodType(_packed_forward, module)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    recording = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
    if recording or x.device.type != "cpu" or x.dtype != weight.dtype:
        return functional.linear(x, weight, self.bias)
    return self._group.output(self._group_index, x)


def _version(tensor: torch.Tensor) -> int:
    # Tensors made under inference mode keep no version counter (nor may they be changed in place
    # outside it): their data pointer alone says whether they are still the packed ones.
    return -1 if tensor.is_inference() else tensor._version


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
