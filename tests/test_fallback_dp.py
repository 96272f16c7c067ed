"""FSDP2 data parallelism only (ep=1) on 2 gloo ranks: dense Llama (vanilla Transformers), Mixtral (generic path).

Each rank takes different sequences of the global batch; the run must equal one process taking
the whole global batch (as grad_accum micro-batches of the same size), and both ranks must hold
one model: the same grad norm and, gathered, the same parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from launch_utils import run_ranks

from workbench.config import ConfigError, DataConfig, ModelConfig, RunConfig
from workbench.parallel.mesh import MeshConfig
from workbench.train.loop import Trainer
from workbench.train.model_setup import resolve_mesh

SHAPE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02),
}


def tiny_config(family: str):
    return transformers.AutoConfig.for_model(family, **SHAPE, **FAMILIES[family])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(tiny_config(request.param)).save_pretrained(path)
    return path


def run_config(ckpt: str, out: str, local_batch: int, **overrides) -> RunConfig:
    # device="cpu", float32: the single-process reference runs like the gloo ranks also on a GPU machine
    return RunConfig.demo(
        model=ModelConfig(preset=None, path=ckpt, dtype="float32", device="cpu"),
        data=DataConfig(kind="synthetic", seq_len=16),
        output_dir=out,
        train__steps=3,
        train__global_batch_size=4,
        train__local_batch_size=local_batch,
        train__lr=1e-2,
        train__warmup_steps=0,
        train__save_final_checkpoint=False,
        **overrides,
    )


class GradNorms:
    def __init__(self):
        self.values = []

    def on_step(self, record):
        self.values.append(record["grad_norm"])


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter, gathered from its FSDP2 shards."""
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach().cpu().clone()  # the single-process reference may run on a GPU, gloo ranks on the CPU


def train(ckpt: str, out: str, local_batch: int, **overrides) -> dict:
    norms = GradNorms()
    trainer = Trainer(run_config(ckpt, out, local_batch, **overrides), callbacks=[norms])
    trainer.setup()
    result = trainer.fit()
    return {
        "losses": result["losses"],
        "grad_norms": norms.values,
        "params": {n: _full(p) for n, p in trainer.model.named_parameters()},
    }


def _two_rank_worker(rank, world, ckpt, out, mesh):
    return train(ckpt, out, local_batch=2, mesh=mesh)


@pytest.mark.slow
def test_two_ranks_are_one_data_parallel_model_equal_to_one_process(checkpoint, tmp_path):
    # the global batch in one micro-batch: on dp=2 each rank's aux loss is its share of that batch's aux loss
    ref = train(str(checkpoint), str(tmp_path / "single"), local_batch=4)
    # A dense model takes the default mesh (dp = world); ep=1 keeps Mixtral whole on each rank (the
    # default would split its experts).
    dense = checkpoint.name.startswith(("llama", "qwen3"))
    mesh = None if dense else MeshConfig(dp=2, ep=1)
    r0, r1 = run_ranks(_two_rank_worker, 2, str(checkpoint), str(tmp_path / "dp"), mesh)
    assert r0["grad_norms"] == r1["grad_norms"]  # one global norm, not each rank's own
    assert r0["params"].keys() == r1["params"].keys() == ref["params"].keys()
    for name in ref["params"]:
        a, b, single = (r["params"][name] for r in (r0, r1, ref))
        assert torch.equal(a, b), name
        # AdamW divides by sqrt(v): float32 rounding of near-zero gradients (summed in another
        # order) moves a few entries by a fraction of lr after 3 steps.
        torch.testing.assert_close(a, single, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(r0["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-4, atol=0.0)


def test_expert_parallelism_needs_experts_the_engine_can_split(tmp_path):
    mixtral, llama = tiny_config("mixtral"), tiny_config("llama")
    with pytest.raises(ConfigError, match=r"mesh ep=2 splits experts, but model_type 'llama' has none.*ep=1"):
        resolve_mesh(MeshConfig(dp=2, ep=2), 2, llama)
    # Mixtral's v5 fused experts run on the engine's generic path: a default mesh splits them.
    assert resolve_mesh(MeshConfig(dp=2, ep=2), 2, mixtral) == MeshConfig(dp=2, ep=2)
    assert resolve_mesh(None, 2, mixtral) == MeshConfig(dp=2, ep=2)
    assert resolve_mesh(None, 2, llama) == MeshConfig(dp=2, ep=1)
    assert resolve_mesh(None, 1, llama) is None


def _jetmoe_config():
    return transformers.AutoConfig.for_model(
        "jetmoe",
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        kv_channels=8,
        num_key_value_heads=2,
        intermediate_size=32,
    )


def _refused_worker(rank, world, ckpt, out):
    try:
        Trainer(run_config(ckpt, out, local_batch=2))
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.slow
@pytest.mark.skipif("jetmoe" not in transformers.CONFIG_MAPPING, reason="no jetmoe in this transformers")
def test_moe_without_fused_experts_fails_before_the_run_directory(tmp_path):
    ckpt = tmp_path / "jetmoe"
    transformers.AutoModelForCausalLM.from_config(_jetmoe_config()).save_pretrained(ckpt)
    errors = run_ranks(_refused_worker, 2, str(ckpt), str(tmp_path / "runs"))
    assert all(e and "experts are not Transformers v5 fused" in e and "mixtral" in e for e in errors), errors
    assert not Path(tmp_path / "runs").exists()


def _export_worker(rank, world, ckpt, out):
    trainer = Trainer(run_config(ckpt, out, local_batch=2, train__export_hf=True, mesh=MeshConfig(dp=2, ep=1)))
    trainer.setup()
    result = trainer.fit()
    return {"hf_dir": result["hf_dir"], "params": {n: _full(p) for n, p in trainer.model.named_parameters()}}


@pytest.mark.slow
def test_export_from_two_fsdp_ranks_loads_in_vanilla_transformers(checkpoint, tmp_path):
    r0, _ = run_ranks(_export_worker, 2, str(checkpoint), str(tmp_path / "runs"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(r0["hf_dir"])
    assert loaded.config.architectures == [type(loaded).__name__]  # not fully_shard's FSDP... class
    state = loaded.state_dict()
    for name, trained in r0["params"].items():
        assert torch.equal(state[name], trained), name  # the trained weights, bit for bit
