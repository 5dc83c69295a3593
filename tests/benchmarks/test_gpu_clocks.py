"""ClockSampler: samples NVML's readings through torch.cuda while the timed steps run, or says why it cannot."""

import time

import torch

from benchmarks.gpu_clocks import ClockSampler


def test_cpu_device_records_why_there_are_no_clocks():
    with ClockSampler(torch.device("cpu")) as clocks:
        pass
    assert clocks.summary() == {"unavailable": "device cpu: no GPU clocks"}


def test_missing_nvml_is_recorded_not_raised(monkeypatch):
    def no_nvml(device=None):
        raise ModuleNotFoundError("No module named 'pynvml'")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    with ClockSampler(torch.device("cuda")) as clocks:
        pass
    assert clocks.summary() == {"unavailable": "ModuleNotFoundError: No module named 'pynvml'"}


def test_samples_summarise_clock_power_and_temperature(monkeypatch):
    readings = iter([1980, 1755, 1830] + [1800] * 1000)
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: next(readings))
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device=None: 650_000)
    monkeypatch.setattr(torch.cuda, "temperature", lambda device=None: 71)
    with ClockSampler(torch.device("cuda"), interval_s=0.01) as clocks:
        time.sleep(0.1)
    s = clocks.summary()
    assert s["samples"] >= 4 and s["sm_clock_mhz_max"] == 1980 and s["sm_clock_mhz_min"] == 1755
    assert s["power_w_median"] == 650.0 and s["temperature_c_max"] == 71
