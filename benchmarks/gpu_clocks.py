"""The GPU's SM clock, power and temperature while a row's timed steps run, sampled on a thread.

Why: rows running the same matmul kernels the same number of times can still differ in those kernels' time
(docs/performance.md); sampled clocks and power say whether the GPU slowed down (power or thermal limits)
during one row and not the other. Reads NVML through torch.cuda's public calls; where NVML is missing the
row records why instead of numbers. Owns the sampling only; the rows decide when it runs.
"""

from __future__ import annotations

import statistics
import threading

import torch

__all__ = ["ClockSampler"]


class ClockSampler:
    """`with ClockSampler(device) as clocks: <timed steps>` (or `start()`/`stop()` where hooks bracket the steps),
    then `clocks.summary()` for the row."""

    def __init__(self, device: torch.device, interval_s: float = 0.1) -> None:
        self.device, self.interval_s = device, interval_s
        self.samples: list[tuple[int, float, int]] = []  # (SM MHz, W, degrees C)
        self.unavailable: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> tuple[int, float, int]:
        return (torch.cuda.clock_rate(self.device), torch.cuda.power_draw(self.device) / 1e3,
                torch.cuda.temperature(self.device))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self._read())

    def start(self) -> ClockSampler:
        if self.device.type != "cuda":
            self.unavailable = f"device {self.device.type}: no GPU clocks"
            return self
        try:
            self.samples.append(self._read())
        except Exception as exc:  # noqa: BLE001 - NVML missing or refused: recorded, the row still runs
            self.unavailable = f"{type(exc).__name__}: {exc}"[:200]
            return self
        self._thread = threading.Thread(target=self._run, name="gpu-clocks", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.samples.append(self._read())

    def __enter__(self) -> ClockSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict:
        if self.unavailable is not None:
            return {"unavailable": self.unavailable}
        clocks, watts, temps = zip(*self.samples)
        return dict(samples=len(self.samples), interval_s=self.interval_s,
                    sm_clock_mhz_median=statistics.median(clocks), sm_clock_mhz_min=min(clocks),
                    sm_clock_mhz_max=max(clocks), power_w_median=statistics.median(watts), power_w_max=max(watts),
                    temperature_c_max=max(temps))
