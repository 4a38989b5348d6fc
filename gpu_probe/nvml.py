"""GPU memory and utilisation through NVML; every field None where there is no driver or GPU."""

from __future__ import annotations

from typing import Any


class Nvml:
    def __init__(self, index: int = 0) -> None:
        self._handle: Any = None
        self.error: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:  # no package, no driver, no device: all mean "unknown", never a crash
            self.error = f"{type(e).__name__}: {e}"

    def read(self) -> dict[str, Any]:
        if self._handle is None:
            return {"memory_used": None, "memory_total": None, "utilization": None}
        try:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            return {"memory_used": int(mem.used), "memory_total": int(mem.total), "utilization": util.gpu / 100.0}
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            return {"memory_used": None, "memory_total": None, "utilization": None}
