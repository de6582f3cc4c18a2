import torch

from backends.packing import pack_linears
from profiler.hardware import machine_info, measure_copy_bandwidth, measure_matvec_bandwidth


def test_copy_bandwidth_is_measured_in_bytes_per_second():
    bandwidth = measure_copy_bandwidth(megabytes=32, repeats=2)
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s: a number, not a unit slip


def test_machine_info_describes_this_machine():
    info = machine_info()
    assert info.logical_cores >= 1 and info.torch_threads >= 1
    assert info.torch_version and info.transformers_version and info.cpu


def test_matvec_bandwidth_counts_the_weight_bytes_once():
    layer = torch.nn.Linear(512, 4096, bias=False)
    bandwidth = measure_matvec_bandwidth(layer, repeats=3)
    assert 1e8 < bandwidth < 1e13
    packed = torch.nn.Linear(512, 4096, bias=False)
    pack_linears(packed)
    assert 1e8 < measure_matvec_bandwidth(packed, repeats=3) < 1e13
