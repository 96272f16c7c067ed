"""MoE health per layer: hand-built routings against hand-computed values, and a tiny run's metrics.jsonl."""

import json
import math
from pathlib import Path

import pytest
import torch

from workbench.config import RunConfig
from workbench.runs.moe_health import HEALTH_KEYS, health_over_steps, load_health
from workbench.train import finetune
from workbench.train.router_entropy import router_entropy_sums
from workbench.train.step_stats import SCALARS, StatsLayout


def test_load_health_on_a_known_routing():
    # layer 0: 8 slots over 4 experts, one expert idle; layer 1: perfectly even; layer 2: no tokens at all
    health = load_health([[4, 0, 2, 2], [2, 2, 2, 2], [0, 0, 0, 0]])
    assert health["moe_dead_share"] == [0.25, 0.0, 1.0]
    assert health["moe_max_share"] == [0.5, 0.25, 0.0]
    assert health["moe_min_share"] == [0.0, 0.25, 0.0]
    # layer 0: mean 2, deviations 2, -2, 0, 0 -> std sqrt(8 / 4) = sqrt(2), CV sqrt(2) / 2
    assert health["moe_load_cv"] == pytest.approx([math.sqrt(2) / 2, 0.0, 0.0])


def test_health_over_steps_sums_the_ranks_load_and_averages_their_entropy():
    # step 1 on two ranks: expert 1 is idle on rank 0 only, so over the run's tokens no expert is dead
    records = [
        {"step": 1, "rank": 0, "expert_load": [[4, 0]], "router_entropy": [0.25]},
        {"step": 1, "rank": 1, "expert_load": [[0, 4]], "router_entropy": [0.75]},
        {"step": 2, "rank": 0, "expert_load": [[2, 0]]},
        {"step": 2, "rank": 1, "expert_load": [[6, 0]]},
        {"step": 3, "rank": 0, "loss": 1.0},  # no load: not a health point
    ]
    health = health_over_steps(records)
    assert health["moe_dead_share"] == [(1, [0.0]), (2, [0.5])]
    assert health["moe_max_share"] == [(1, [0.5]), (2, [1.0])]
    assert health["moe_min_share"] == [(1, [0.5]), (2, [0.0])]
    assert health["moe_load_cv"] == [(1, [0.0]), (2, [1.0])]
    assert health["router_entropy"] == [(1, [0.5])]  # only step 1 recorded it


def test_router_entropy_on_known_logits():
    # 4 experts: token 0 spreads evenly (H = ln 4, normalised 1), token 1 splits between two (ln 2 / ln 4 = 0.5),
    # token 2 puts (all but e^-60 of) it on one (0): the layer's mean is 0.5
    ninf = float("-inf")
    layer0 = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, ninf, ninf], [60.0, 0.0, 0.0, 0.0]])
    # a second layer with [batch, seq, experts] logits: every token even -> 1
    layer1 = torch.zeros(2, 3, 4)
    sums = router_entropy_sums([layer0, layer1])
    assert sums.dtype == torch.float64 and sums.shape == (2,)
    assert sums.tolist() == pytest.approx([0.5, 1.0], abs=1e-6)


def test_router_entropy_rides_the_stats_vector():
    layout = StatsLayout((1, 2), (), 2)
    scalars = {k: torch.tensor(float(i)) for i, k in enumerate(SCALARS)}
    packed = layout.pack(scalars, torch.tensor([[3, 5]]), None, torch.tensor([0.25, 0.75]))
    values = layout.unpack(packed.tolist())
    assert values["expert_load"] == [[3, 5]] and values["router_entropy"] == [0.25, 0.75]
    assert StatsLayout().unpack(StatsLayout().pack(scalars, None, None).tolist())["router_entropy"] is None


def test_a_tiny_run_records_moe_health_per_layer(tmp_path):
    rc = RunConfig.demo(
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        train__steps=2,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__save_final_checkpoint=False,
    )
    out = finetune(rc)
    lines = (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        layers = len(r["expert_load"])
        assert layers > 0
        for key in HEALTH_KEYS:
            assert len(r[key]) == layers, key
        assert r["moe_dead_share"] == [sum(c == 0 for c in row) / len(row) for row in r["expert_load"]]
        assert r["moe_max_share"] == [max(row) / sum(row) for row in r["expert_load"]]
        assert all(0.0 < h <= 1.0 for h in r["router_entropy"])
        # the tiny model's barely trained router spreads its tokens almost evenly
        assert all(h > 0.9 for h in r["router_entropy"])


def test_the_run_readers_hold_the_health_lists_for_the_lab_and_refuse_crafted_ones():
    from workbench.runs.run_index import SERIES_FIELDS, SERIES_LIST_MAX, IndexLimits, SeriesRecords

    series = SeriesRecords(SERIES_FIELDS, IndexLimits())
    good = {"step": 1, "rank": 0, "loss": 2.0, "expert_load": [[1, 0]], "moe_dead_share": [0.5], "router_entropy": [1]}
    series.take(good)
    crafted = {"step": 2, "rank": 0, "moe_dead_share": [0.0] * (SERIES_LIST_MAX + 1), "router_entropy": ["x"]}
    series.take(crafted)
    assert series.records() == [
        {"step": 1, "rank": 0, "loss": 2.0, "moe_dead_share": [0.5], "router_entropy": [1]},
        {"step": 2, "rank": 0},
    ]
