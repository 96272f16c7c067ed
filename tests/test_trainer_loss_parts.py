"""The trainer's cross-entropy and aux loss come apart from one forward: loss = ce + coef x aux, each computed once.

A large router_aux_loss_coef makes the old way (the model adds coef x aux to the loss, the trainer
subtracts it again) visible: in float32 the cross-entropy came back with an error of half an ulp
of coef x aux, far above the tolerance here.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from workbench.config import DataConfig, ModelConfig, RunConfig
from workbench.models.full_state import full_state_dict
from workbench.train.loop import Trainer

COEF = 1e6  # coef x aux ~ 1e6: one float32 ulp there is 0.06, the cross-entropy is ~6


def _rc(tmp_path, **overrides) -> RunConfig:
    base = dict(
        train__steps=1, train__global_batch_size=2, train__local_batch_size=2, train__save_final_checkpoint=False
    )
    return RunConfig.demo(
        model=ModelConfig(preset="tiny", dtype="float32", device="cpu", router_aux_loss_coef=COEF),
        data=DataConfig(kind="synthetic", seq_len=16),
        output_dir=str(tmp_path / "runs"),
        **{**base, **overrides},
    )


def _first_batch(trainer: Trainer):
    """The batch the trainer's first step takes, without taking it."""
    state = trainer.stream.state_dict()
    gbs = trainer.rc.train.global_batch_size
    batch = trainer.stream.next_batch(gbs, 0, gbs)
    trainer.stream.load_state_dict(state)
    return batch


def _reference(model: torch.nn.Module, batch) -> tuple[float, float]:
    """Vanilla Transformers: its cross-entropy (no router logits: nothing added) and its own aux loss."""
    items = (batch.labels[:, 1:] != -100).sum().to(torch.float32)
    kwargs = dict(
        input_ids=batch.input_ids,
        labels=batch.labels,
        position_ids=batch.position_ids,
        num_items_in_batch=items,
        use_cache=False,
    )
    with torch.no_grad():
        ce = model(**kwargs, output_router_logits=False).loss
        aux = model(**kwargs, output_router_logits=True).aux_loss
    return float(ce), float(aux)


def _first_record(trainer: Trainer) -> dict:
    trainer.train_step(1)
    (record,) = trainer.collect(wait=True)
    return record


def _check(record: dict, ce: float, aux: float, rel: float) -> None:
    assert aux > 0.1 and COEF * aux > 1e4 * ce  # the aux term dominates the loss
    assert record["ce_loss"] == pytest.approx(ce, rel=rel, abs=0)
    assert record["aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert record["loss"] == pytest.approx(record["ce_loss"] + COEF * record["aux_loss"], rel=1e-12)


def test_engine_model_ce_and_aux_equal_vanilla_transformers(tmp_path):
    trainer = Trainer(_rc(tmp_path))
    trainer.setup()
    vanilla = transformers.AutoModelForCausalLM.from_config(trainer.hf_config)
    vanilla.load_state_dict(full_state_dict(trainer.model), strict=True)
    ce, aux = _reference(vanilla, _first_batch(trainer))
    _check(_first_record(trainer), ce, aux, rel=1e-5)  # the engine's experts: float32 rounding apart


def test_vanilla_model_ce_and_aux_come_apart_too(tmp_path):
    trainer = Trainer(_rc(tmp_path))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(trainer.hf_config)  # vanilla Transformers
    ce, aux = _reference(model, _first_batch(trainer))
    trainer.setup(model=model)
    _check(_first_record(trainer), ce, aux, rel=1e-6)  # the same model's own cross-entropy


def test_drop_in_loss_is_ce_plus_coef_aux_as_transformers_returns_it(tmp_path):
    """model(...).loss of the engine's model, asked for router logits, is Transformers' ce + coef x aux."""
    trainer = Trainer(_rc(tmp_path))
    trainer.setup()
    batch = _first_batch(trainer)
    kwargs = dict(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids, use_cache=False)
    with torch.no_grad():
        out = trainer.model(**kwargs, output_router_logits=True)
        plain = trainer.model(**kwargs, output_router_logits=False)
    assert plain.aux_loss is None
    torch.testing.assert_close(out.loss, plain.loss + COEF * out.aux_loss, rtol=1e-6, atol=0)


def _vanilla_first_record(tmp: str, local_batch: int) -> dict:
    """One step of a vanilla Transformers model through the Trainer (FSDP2 over dp on more than one rank)."""
    import torch.distributed as dist

    from workbench.models.mesh_build import shard_without_engine
    from workbench.parallel.mesh import MeshConfig

    trainer = Trainer(_rc_path(tmp, local_batch))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(trainer.hf_config)
    if dist.is_initialized():
        model = shard_without_engine(model, MeshConfig(dp=dist.get_world_size(), ep=1))
    trainer.setup(model=model)
    return _first_record(trainer)


def _rc_path(tmp: str, local_batch: int) -> RunConfig:
    from pathlib import Path

    return _rc(Path(tmp), train__global_batch_size=4, train__local_batch_size=local_batch)


def _vanilla_rank(rank, world, tmp):
    return _vanilla_first_record(tmp, local_batch=2)


@pytest.mark.slow
def test_vanilla_model_on_two_ranks_has_the_global_batch_aux_loss(tmp_path):
    """Each rank's aux loss is its share of the global micro-batch's, as for the engine's model: 2 ranks of 2
    sequences give one process's 4 (a per-rank mean, the old convention for vanilla models, does not)."""
    from launch_utils import run_ranks

    ref = _vanilla_first_record(str(tmp_path / "one"), local_batch=4)
    r0, r1 = run_ranks(_vanilla_rank, 2, str(tmp_path / "two"), timeout=180)
    assert r0["aux_loss"] == r1["aux_loss"] == pytest.approx(ref["aux_loss"], rel=1e-5)
    assert r0["ce_loss"] == pytest.approx(ref["ce_loss"], rel=1e-5)
