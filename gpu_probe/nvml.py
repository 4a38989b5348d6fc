"""GPU memory and utilisation through NVML; every field None where there is no driver or GPU. Also the
GPU's name and how many the host has (what kvgate picks a node's performance prior from: an 8B on an
H100 steps faster than on an A100)."""

from __future__ import annotations

from typing import Any


class Nvml:
    def __init__(self, index: int = 0) -> None:
        self._handle: Any = None
        self.name: str | None = None
        """The GPU's model as NVML names it (``NVIDIA H100 80GB HBM3``); None: unknown."""
        self.count: int | None = None
        """GPUs the host shows (a tensor-parallel engine spans them: the probe runs beside one engine)."""
        self.error: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self.count = int(pynvml.nvmlDeviceGetCount())
        except Exception as e:  # no package, no driver, no device: all mean "unknown", never a crash
            self._handle, self.name, self.count = None, None, None
            self.error = f"{type(e).__name__}: {e}"

    def read(self) -> dict[str, Any]:
        if self._handle is None:
            return {"memory_used": None, "memory_total": None, "utilization": None}
        try:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            return {"memory_used": int(mem.used), "memory_total": int(mem.total), "utilization": util.gpu / 100.0,
                    "name": self.name, "count": self.count}
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            return {"memory_used": None, "memory_total": None, "utilization": None}
