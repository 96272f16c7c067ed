"""The Studio's MoE health small multiples: a line per layer per figure, drawn from real and hand-built records."""

import pytest

from workbench.config import RunConfig
from workbench.runs.moe_health import HEALTH_KEYS
from workbench.ui.moe_health_plot import EMPTY_TEXT, MoEHealthPlots, health_lines
from workbench.ui.plots import LivePlots


def test_health_lines_over_two_ranks():
    records = [
        {"step": 1, "rank": 0, "expert_load": [[4, 0], [1, 1]], "router_entropy": [0.2, 0.4]},
        {"step": 1, "rank": 1, "expert_load": [[4, 0], [1, 1]], "router_entropy": [0.4, 0.6]},
        {"step": 2, "rank": 0, "expert_load": [[2, 2], [0, 2]], "router_entropy": [0.5, 0.5]},
        {"step": 2, "rank": 1, "expert_load": [[2, 2], [0, 2]], "router_entropy": [0.5, 0.5]},
    ]
    lines = health_lines(records)
    assert set(lines) == set(HEALTH_KEYS)
    assert lines["moe_dead_share"] == [([1, 2], [0.5, 0.0]), ([1, 2], [0.0, 0.5])]
    assert lines["router_entropy"][0] == ([1, 2], [pytest.approx(0.3), 0.5])
    plots = MoEHealthPlots()
    plots.draw(records)
    drawn = {(t.name, t.xaxis): (list(t.x), list(t.y)) for t in plots.figure.data}
    # one panel per figure (x, x2, ...), one line per layer in each
    assert len(drawn) == 2 * len(HEALTH_KEYS)
    assert drawn[("layer 1", "x")] == ([1, 2], [0.0, 0.5])
    assert "2 MoE layers" in plots.title.value


def test_live_plots_draw_the_health_of_a_real_run(tmp_path):
    from workbench.runs.run_dir import RunDir
    from workbench.train import finetune

    out = finetune(
        RunConfig.demo(output_dir=str(tmp_path), data__seq_len=64, train__steps=2, train__save_final_checkpoint=False)
    )
    records = RunDir.open(out["run_dir"]).read_metrics()
    plots = LivePlots()
    assert EMPTY_TEXT in plots.health.title.value
    plots.update(records)
    layers = len(records[0]["expert_load"])
    health = {(t.name, t.xaxis): t for t in plots.health.figure.data}
    assert len(health) == layers * len(HEALTH_KEYS)
    entropy_axis = f"x{HEALTH_KEYS.index('router_entropy') + 1}"
    assert list(health[("layer 0", entropy_axis)].y) == [r["router_entropy"][0] for r in records]
    assert plots.health.widget in plots.widget.children


def test_health_titles_on_two_lines_and_whole_step_ticks():
    records = [{"step": 20, "rank": r, "expert_load": [[4, 0], [1, 1]], "router_entropy": [0.2, 0.4]} for r in (0, 1)]
    plots = MoEHealthPlots()
    plots.draw(records)
    # five titles side by side at a fifth of the figure each: broken in two, none wider than its panel
    assert all(a.text.count("<br>") == 1 for a in plots.figure.layout.annotations)
    # one step drawn: whole-step ticks (plotly's own put 19.5 and 20.5 beside it)
    assert {plots.figure.layout[f"xaxis{i if i > 1 else ''}"].dtick for i in range(1, len(HEALTH_KEYS) + 1)} == {1}
