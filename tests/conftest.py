"""Shared test fixtures: a tiny MoE checkpoint on disk and a 2-rank CPU cluster."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """(config, path) of a saved random tiny Qwen3-MoE: 8 experts, top-2, aux loss on; read-only, one per session."""
    import torch
    import transformers
    from tiny_models import tiny_qwen3_moe

    cfg = tiny_qwen3_moe(num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("moe_checkpoint")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return cfg, path


@pytest.fixture(scope="module")
def cluster():
    """A 2-rank CPU (gloo) ipyparallel cluster, one per test module (a module's last test may restart it)."""
    pytest.importorskip("ipyparallel")
    from workbench.cluster import Cluster

    c = Cluster(n=2, devices="cpu")
    yield c
    c.stop()


def pytest_collection_modifyitems(config, items):
    """The lab extension's server tests (tests/lab, each a Jupyter server) are slow: out of the fast loop."""
    lab = Path(__file__).parent / "lab"
    for item in items:
        if lab in item.path.parents:
            item.add_marker(pytest.mark.slow)
