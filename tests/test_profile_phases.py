"""The profiler's MoE phases on the generic path, for families other than Qwen3-MoE (CPU, one process)."""

from __future__ import annotations

import pytest

from workbench.config import RunConfig


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-gpt-oss"])  # router under `gate` / under `router`
def test_a_profiled_step_reports_the_moe_phases(preset, tmp_path):
    from workbench.train.profile import profile_finetune
    from workbench.ui.profile import load_profile

    result = profile_finetune(
        RunConfig.demo(
            model__preset=preset,
            output_dir=str(tmp_path),
            train__steps=2,
            train__global_batch_size=2,
            train__local_batch_size=2,
            train__save_final_checkpoint=False,
        )
    )
    (prof,) = load_profile(result["run_dir"])
    assert prof["device"] == "cpu" and prof["steps"] == 1
    phases = prof["phases_ms"]
    assert {"attention", "router", "dispatch", "experts", "combine", "forward", "backward"} <= set(phases), phases
    assert all(v > 0 for v in phases.values()), phases
    # the MoE phases sit inside the forward (and its recompute-free backward runs outside them)
    assert sum(phases[p] for p in ("router", "dispatch", "experts", "combine")) < phases["forward"], phases
