import torch

from profiler.hardware import machine_info, measure_copy_bandwidth, measure_matvec_bandwidth


def test_copy_bandwidth_is_measured_in_bytes_per_second():
    bandwidth = measure_copy_bandwidth(megabytes=32, repeats=2)
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s: a number, not a unit slip


def test_machine_info_describes_this_machine():
    info = machine_info()
    assert info.logical_cores >= 1 and info.torch_threads >= 1
    assert info.torch_version and info.transformers_version and info.cpu


def test_matvec_bandwidth_counts_the_weight_bytes_once():
    bandwidth = measure_matvec_bandwidth(torch.randn(4096, 512), repeats=3)
    assert 1e8 < bandwidth < 1e13
