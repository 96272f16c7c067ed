"""Sizes in the units people write them: the tiny model has 190K parameters, not "0.00019 B"."""

from __future__ import annotations

from workbench.ui.logic import format_params
from workbench.ui.panels import ModelPanel


def test_parameter_counts_take_the_unit_that_fits():
    assert [format_params(n) for n in (512, 190_464, 3_350_000, 30_532_122_624)] == ["512", "190K", "3.35M", "30.5B"]


def test_the_model_panel_says_the_tiny_model_has_thousands_of_parameters():
    summary = ModelPanel(preset="tiny").summary.value
    assert "190K params, 116K active" in summary and " B " not in summary, summary
