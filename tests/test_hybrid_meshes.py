"""The hybrid families' tiny presets on DP2 x EP2 (two gloo ranks) against one process of vanilla Transformers.

Each rank runs the engine (its Mamba2 or Gated DeltaNet mixers, its experts over the all-to-all dispatch) on its own
half of the batch; the summed loss, every gradient, the experts each rank holds and the gathered save loaded by
vanilla Transformers must equal one process on the whole batch (tests/test_generic_families.ep_step_on).
"""

from __future__ import annotations

import pytest
from launch_utils import run_ranks
from test_generic_families import check_ep, ep_step_on

from workbench.presets import build_preset_config

HYBRID_TINY_PRESETS = ["tiny-nemotron-h", "tiny-qwen3.5-moe", "tiny-qwen3-next"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", HYBRID_TINY_PRESETS)
def test_hybrid_tiny_preset_on_dp2_ep2_equals_one_process(preset, tmp_path):
    cfg = build_preset_config(preset)
    check_ep(run_ranks(ep_step_on, 2, cfg, str(tmp_path / "saved"), timeout=300))
