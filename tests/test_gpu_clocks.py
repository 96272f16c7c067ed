"""The bench's SM clock / power sampling: its summaries, and what a row says where NVML cannot sample."""

from __future__ import annotations

import pytest
import torch

from workbench.bench.gpu_clocks import ClockSample, ClockSampler, merge, summarize
from workbench.bench.report import clock_lines


def _samples(mhz_watts_reasons):
    return [ClockSample(float(i), m, w, r) for i, (m, w, r) in enumerate(mhz_watts_reasons)]


def test_summary_counts_power_cap_and_heat_separately():
    s = summarize(
        _samples([(1980, 400.0, 0x0), (1650, 699.0, 0x4), (1500, 700.0, 0x84), (1700, 650.0, 0x20)]),
        {"power_limit_w": 700.0, "sm_clock_mhz_max": 1980},
    )
    assert s["samples"] == 4 and s["sm_clock_mhz_min"] == 1500
    assert s["sm_clock_mhz_mean"] == pytest.approx((1980 + 1650 + 1500 + 1700) / 4)
    assert s["power_w_mean"] == pytest.approx((400 + 699 + 700 + 650) / 4)
    assert s["power_capped_share"] == pytest.approx(0.5) and s["thermal_share"] == pytest.approx(0.25)
    assert s["power_limit_w"] == 700.0 and summarize([]) is None


def test_rounds_merge_weighted_by_their_samples():
    a = summarize(_samples([(1900, 600.0, 0)] * 3))
    b = summarize(_samples([(1500, 700.0, 4)]))
    m = merge([a, None, b])
    assert m["samples"] == 4 and m["sm_clock_mhz_mean"] == pytest.approx((3 * 1900 + 1500) / 4)
    assert m["power_capped_share"] == pytest.approx(0.25) and m["sm_clock_mhz_min"] == 1500
    assert merge([None, None]) is None and "energy_j" not in m
    with_energy = [{**a, "energy_j": 30.0, "window_s": 0.5}, {**b, "energy_j": 12.0, "window_s": 0.2}]
    e = merge(with_energy)
    assert e["energy_j"] == 42.0 and e["window_s"] == pytest.approx(0.7)
    assert "energy_j" not in merge([with_energy[0], b])  # a round without the counter: no total


def test_sampler_on_a_cpu_device_says_why_it_sampled_nothing():
    sampler = ClockSampler(torch.device("cpu"))
    sampler.start()
    assert sampler.stop() is None and sampler.unavailable == "not a CUDA device"


def test_table_lines_name_clock_power_and_the_unsampled():
    rows = [
        {
            "name": "anchor",
            "status": "ok",
            "gpu_clocks": merge(
                [
                    summarize(
                        _samples([(1950, 655.0, 0x4), (1980, 640.0, 0)]),
                        {"power_limit_w": 700.0, "sm_clock_mhz_max": 1980},
                    )
                ]
            ),
        },
        {"name": "engine", "status": "ok", "gpu_clocks": None, "gpu_clocks_unavailable": "not a CUDA device"},
        {"name": "engine_x", "status": "failed", "reason": "boom"},
    ]
    lines = clock_lines(rows)
    assert lines[0] == (
        "gpu clocks anchor: SM 1,965 MHz mean, 1,950 min (max 1980); 648 W of 700 W; power cap held the clock in 50% "
        "of 2 samples, heat in 0%"
    )
    assert lines[1] == "gpu clocks engine: not sampled (not a CUDA device)" and len(lines) == 2
    rows[0]["gpu_clocks"]["energy_j_per_step"] = 81.25
    assert clock_lines(rows)[0].endswith("heat in 0%; 81.2 J a step")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NVML samples a GPU)")
def test_sampler_reads_a_busy_gpu():
    pytest.importorskip("pynvml", reason="NVML bindings not installed (pip install nvidia-ml-py)")
    sampler = ClockSampler(torch.device("cuda"), period_s=0.02)
    assert sampler.unavailable is None, sampler.unavailable
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    sampler.start()
    for _ in range(200):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    s = sampler.stop()
    assert s["samples"] > 0 and 0 < s["sm_clock_mhz_min"] <= s["sm_clock_mhz_mean"] <= s["sm_clock_mhz_max"]
    assert 0 < s["power_w_mean"] and s["power_limit_w"] > 0 and 0 <= s["power_capped_share"] <= 1
    # the energy counter over the window: about the mean power times its length (samples are instants)
    assert s["window_s"] > 0 and 0.3 < s["energy_j"] / (s["power_w_mean"] * s["window_s"]) < 3
