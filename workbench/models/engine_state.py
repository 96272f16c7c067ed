"""What the engine resolved and built for one model, in one typed object: `engine_state(model)`.

The builders (models/generic.py, models/mesh_build.py, models/lora.py), the router hooks (models/router_aux.py),
the trainer (its CUDA-graphed stack, the checkpoints' expert mesh) and the bench read and write the model-level
state here, instead of each setting an attribute of its own on Transformers' model. The engine's causal LM class
(models/generic_extras.EngineCausalLM) declares the field; a Transformers model the engine did not change (a dense
model sharded over a mesh, one given router hooks) gets it on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from workbench.backends import BackendConfig
from workbench.models.lora_targets import LoraPlan
from workbench.models.router_records import RouterLogitSink
from workbench.parallel.mesh import MeshConfig


@dataclass
class EngineState:
    """One model's engine state; None where that part was not built."""

    backend: BackendConfig | None = None  # the resolved backends the engine's modules were installed with
    mesh: MeshConfig | None = None  # the mesh the model was built on
    device_mesh: Any = None  # its torch DeviceMesh (dims dp, ep, edp)
    expert_range: tuple[int, int] | None = None  # this rank's experts [first, last) under expert parallelism
    checkpoint_read: Any = None  # what the per-rank checkpoint read took from disk (models/sliced_load)
    lora: Any = None  # the LoraConfig whose adapters the model holds (config_lora.LoraConfig)
    lora_plan: LoraPlan | None = None  # which modules and expert weights they sit on
    router_sink: RouterLogitSink | None = None  # where the router hooks put one forward's logits
    stack_graphs: Any = None  # the decoder stack's CUDA graphs (train/stack_graphs.StackGraphs)
    ep_edp_mesh: Any = None  # the (ep, edp) DeviceMesh the checkpoints view expert shards on (train/expert_state)


def engine_state(model: nn.Module) -> EngineState:
    """`model`'s EngineState, an empty one attached on first use."""
    state = getattr(model, "workbench_state", None)
    if state is None:
        state = EngineState()
        model.workbench_state = state
    return state
