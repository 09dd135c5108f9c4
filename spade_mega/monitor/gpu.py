"""GPU stats from NVML (``nvidia-ml-py``, imported lazily) as ``gpu/<index>/...`` metrics.

Every GPU NVML sees on this node is sampled (NVML ignores ``CUDA_VISIBLE_DEVICES``, so the writing rank reports the
whole node). Without a driver or library, NVML raises at init (or when listing the GPUs): the stats degrade to
nothing, said once in the log.
A query a GPU does not support (power on some boards, anything on a MIG slice) leaves out just that metric.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("spade_mega.monitor")
GIB = float(1 << 30)


@dataclass(frozen=True)
class GpuReading:
    """What NVML said about one GPU; None where the query is not supported."""

    index: int
    memory_used_bytes: Optional[int] = None
    memory_total_bytes: Optional[int] = None
    utilization_pct: Optional[float] = None
    power_mw: Optional[float] = None
    temperature_c: Optional[float] = None


def gpu_metrics(readings: Sequence[GpuReading]) -> dict[str, float]:
    """Readings as metrics: ``gpu/<i>/memory_used_gib``, ``memory_total_gib``, ``utilization_pct``, ``power_w``,
    ``temperature_c`` (only those NVML answered)."""
    out: dict[str, float] = {}
    for r in readings:
        values = {"memory_used_gib": None if r.memory_used_bytes is None else r.memory_used_bytes / GIB,
                  "memory_total_gib": None if r.memory_total_bytes is None else r.memory_total_bytes / GIB,
                  "utilization_pct": r.utilization_pct,
                  "power_w": None if r.power_mw is None else r.power_mw / 1000.0,
                  "temperature_c": r.temperature_c}
        out.update({f"gpu/{r.index}/{name}": float(v) for name, v in values.items() if v is not None})
    return out


class GpuStats:
    """Samples NVML on demand; ``sample()`` returns ``{}`` for good once NVML turned out to be unusable."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] = []
        self._disabled = False

    def _start(self) -> bool:
        if self._disabled:
            return False
        if self._nvml is not None:
            return True
        try:
            import pynvml

            pynvml.nvmlInit()
        except ImportError:
            return self._disable("nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        except pynvml.NVMLError as exc:
            return self._disable(f"NVML is unavailable ({exc}: no NVIDIA driver on this machine?)")
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:  # started, then could not count: a lost GPU, a driver being reloaded
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass
            return self._disable(f"NVML cannot list the GPUs ({exc})")
        self._nvml = pynvml
        for index in range(count):
            try:
                self._handles.append((index, pynvml.nvmlDeviceGetHandleByIndex(index)))
            except pynvml.NVMLError as exc:
                log.info("no GPU stats for GPU %d: %s", index, exc)
        return True

    def _disable(self, why: str) -> bool:
        self._disabled = True
        log.info("no GPU stats: %s", why)
        return False

    def sample(self) -> dict[str, float]:
        if not self._start():
            return {}
        return gpu_metrics([self._read(index, handle) for index, handle in self._handles])

    def _read(self, index: int, handle: Any) -> GpuReading:
        nvml = self._nvml
        memory = self._query(nvml.nvmlDeviceGetMemoryInfo, handle)
        utilization = self._query(nvml.nvmlDeviceGetUtilizationRates, handle)
        return GpuReading(
            index=index,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization_pct=None if utilization is None else float(utilization.gpu),
            power_mw=self._query(nvml.nvmlDeviceGetPowerUsage, handle),
            temperature_c=self._query(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU))

    def _query(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:  # not supported on this board / slice, or the GPU fell off the bus
            return None

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml, self._handles = None, []
