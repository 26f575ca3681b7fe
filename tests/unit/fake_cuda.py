"""A CUDA runtime as torch.cuda shows it, for testing the CUDA path on a CPU: devices, their
properties, one RNG state per device, the allocator's statistics. Nothing runs on it."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class FakeCuda:
    """`count` GPUs named `name` with `sms` SMs and compute capability `major`.`minor`."""

    def __init__(self, monkeypatch, count: int, name="NVIDIA H100 80GB HBM3", sms=132, cc=(9, 0)):
        self.count, self.current, self.name, self.sms, self.cc = count, 0, name, sms, cc
        # Distinct states, so that a restore from the wrong device shows.
        self.rng = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}
        self.stats: dict[str, int] = {}
        cuda = torch.cuda
        for attr, fn in {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "current_device": lambda: self.current,
            "set_device": self.set_device,
            "get_device_properties": self.properties,
            "get_device_capability": lambda device=None: self.cc,
            "get_device_name": lambda device=None: self.name,
            "get_rng_state": self.get_rng_state,
            "set_rng_state": self.set_rng_state,
            "get_rng_state_all": lambda: [self.get_rng_state(i) for i in range(self.count)],
            "set_rng_state_all": self.set_rng_state_all,
            "memory_stats": lambda device=None: dict(self.stats),
            # A bf16 tensor can be made on any GPU: emulated below compute capability 8.
            "_check_bf16_tensor_supported": lambda device: True,
        }.items():
            monkeypatch.setattr(cuda, attr, fn)

    def _index(self, device) -> int:
        if device is None or device == "cuda":
            return self.current
        index = device.index if isinstance(device, torch.device) else int(device)
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def set_device(self, device) -> None:
        self.current = self._index(device)

    def properties(self, device=None):
        self._index(device)
        major, minor = self.cc
        return SimpleNamespace(
            name=self.name, multi_processor_count=self.sms, major=major, minor=minor
        )

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.rng[self._index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.rng[self._index(device)] = state.clone()

    def set_rng_state_all(self, states) -> None:
        for i, state in enumerate(states):  # as torch.cuda.set_rng_state_all does
            self.set_rng_state(state, i)
