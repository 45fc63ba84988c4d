"""One name per device: `torch.device("cuda")` names no GPU, while every tensor made on it reports `cuda:N`, so
a device kept unindexed never equals its own tensors' devices (each such comparison silently took a slow or
fallback path on GPUs). Devices a cache keeps are made exact here."""
from __future__ import annotations

import torch


def exact_device(device) -> torch.device:
    """`device` with the GPU index its tensors report (the current device for a bare "cuda")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
