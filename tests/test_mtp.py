"""train.mtp_loss_weight: multi-token prediction's loss is refused, naming why, while Transformers builds no MTP layers.

Transformers 5.25's Nemotron-H reads num_nextn_predict_layers / mtp_layers_block_type into its config and skips a
checkpoint's mtp.* weights on load; DeepSeek-V3-like families skip their trailing MTP layers the same way. The model
a run trains has no MTP head, so a weight above 0 is refused before any weights are built (workbench/models/mtp.py).
"""

from __future__ import annotations

import pytest
import torch
from generic_families import tiny_config
from torch import nn

from workbench.config import ConfigError, ModelConfig, RunConfig
from workbench.config_train import TrainConfig
from workbench.models.meta_model import meta_model
from workbench.models.mtp import built_mtp_modules, check_mtp_loss
from workbench.train.world_checks import check_world


@pytest.mark.parametrize("weight", [-0.1, float("nan"), "0.3", True])
def test_mtp_loss_weight_must_be_a_number_at_least_zero(weight):
    with pytest.raises(ConfigError, match=r"train.mtp_loss_weight must be a finite number >= 0.0"):
        TrainConfig(mtp_loss_weight=weight)


@pytest.mark.parametrize("family", ["nemotron_h", "deepseek_v3"])
def test_declared_mtp_layers_that_transformers_does_not_build_are_named(family):
    model = meta_model(tiny_config(family, num_nextn_predict_layers=1))
    assert built_mtp_modules(model) == []  # the config declares one, the model holds none
    with pytest.raises(
        ConfigError,
        match=rf"train.mtp_loss_weight=0.3 needs a model with MTP layers: model_type '{family}' declares 1 "
        r"multi-token prediction layer \(num_nextn_predict_layers=1\), but transformers .* builds none of them .*"
        r"set train.mtp_loss_weight to 0$",
    ):
        check_mtp_loss(model, 0.3)


def test_mtp_modules_a_model_builds_are_found_and_still_refused():
    # a Transformers release that builds them: the trainer takes no loss from them, and says so
    model = meta_model(tiny_config("nemotron_h", num_nextn_predict_layers=1))
    model.model.mtp = nn.ModuleList([nn.Linear(4, 4)])
    assert built_mtp_modules(model) == ["model.mtp"]
    with pytest.raises(ConfigError, match=r"builds multi-token prediction modules .*\(model.mtp\), and the trainer "):
        check_mtp_loss(model, 0.5)


def test_a_run_with_mtp_loss_weight_is_refused_before_any_work():
    rc = RunConfig.demo(model=ModelConfig(preset="tiny-nemotron-h"), train__mtp_loss_weight=0.5)
    with pytest.raises(ConfigError, match=r"model_type 'nemotron_h' has no multi-token prediction layers"):
        check_world(rc, 1, rc.model.hf_config(), torch.device("cpu"))
    off = rc.with_overrides({"train.mtp_loss_weight": 0.0})
    check_world(off, 1, off.model.hf_config(), torch.device("cpu"))  # 0: nothing asked, nothing refused
