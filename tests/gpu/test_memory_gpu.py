"""GPU-only checks of the memory figures (marker `gpu`; skipped without CUDA). Run on a GPU box:
`python -m pytest tests/gpu -m gpu` (2 passed on 2 x H200, 2026-11-30)."""

from __future__ import annotations

import pytest
import torch

from hf_zero3.callbacks.memory import gpu_memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_torch_figures_track_an_allocation_and_pinned_host_memory():
    before = gpu_memory()
    block = torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda")  # 0.25 GiB
    pinned = torch.empty(64 * 1024**2, dtype=torch.uint8).pin_memory()  # 64 MiB
    after = gpu_memory()
    assert after["gpu_allocated_gib"] - before["gpu_allocated_gib"] == pytest.approx(0.25, abs=0.01)
    assert after["gpu_peak_allocated_gib"] >= before["gpu_allocated_gib"] + 0.24  # the peak saw the new block
    assert after["pinned_host_gib"] - before.get("pinned_host_gib", 0.0) >= 0.06
    del block, pinned


def test_nvml_figures_come_from_the_same_gpu():
    pytest.importorskip("pynvml")
    stats = gpu_memory()
    assert stats["gpu_used_gib"] >= stats["gpu_reserved_gib"] * 0.9  # the device sees at least torch's reservation
    assert 0 <= stats["gpu_util_pct"] <= 100 and stats["gpu_power_w"] > 0
