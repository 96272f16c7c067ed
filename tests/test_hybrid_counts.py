"""Hybrid models counted from the config: parameters, FLOPs per token and the memory estimate, by hand for tiny configs.

The tests' tiny Nemotron-H (pattern "ME*E": Mamba2, MoE, attention, MoE) and Qwen3.5-MoE (a Gated DeltaNet layer and
an attention layer, each before its MoE): hidden H = 32, vocab V = 96, 4 heads of 8 (2 kv heads), 4 experts of width
16 (top 2), a shared expert of width 16. Every figure below is worked out from the module shapes of Transformers'
model, and the parameter counts are checked against the real modules too.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config

from workbench.config import preset_config
from workbench.mixer_counts import gated_deltanet_counts, mamba2_counts
from workbench.models.families import LayerBlocks
from workbench.params import layer_blocks, param_counts
from workbench.train.metrics import flops_per_token
from workbench.ui.memory import estimate_memory


def _real_params(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())


def test_nemotron_h_layers_are_one_block_each():
    assert layer_blocks(tiny_config("nemotron_h")) == (
        LayerBlocks("mamba2", None),
        LayerBlocks(None, "moe"),
        LayerBlocks("attention", None),
        LayerBlocks(None, "moe"),
    )
    assert layer_blocks(tiny_config("qwen3_5_moe_text")) == (
        LayerBlocks("gated_deltanet", "moe"),
        LayerBlocks("attention", "moe"),
    )


def test_lara_mini_counts_its_sliding_attention_ungated_query_and_shared_expert():
    # Lara-Mini: Qwen3.5's Gated DeltaNet beside sliding-window and full Qwen3 attention (no query gate), and a
    # shared expert added without a gate; the counts must match the real modules
    if "lara_mini" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no lara_mini")
    cfg = tiny_config("lara_mini")
    assert layer_blocks(cfg) == (
        LayerBlocks("gated_deltanet", "moe"),
        LayerBlocks("attention", "moe"),
        LayerBlocks("attention", "moe"),
    )
    assert param_counts(cfg).total == _real_params(cfg)


def test_mamba2_by_hand():
    # 4 heads of 8 (inner d = 32), 2 groups of state 8, conv kernel 4 with bias, chunks of 4 tokens
    mamba = mamba2_counts(tiny_config("nemotron_h"))
    in_width = 2 * 32 + 2 * 2 * 8 + 4  # z, x|B|C, dt = 100
    assert mamba.matmul == 32 * in_width + 32 * 32 == 4224  # in_proj, out_proj
    assert mamba.params == 4224 + (64 * 4 + 64) + 3 * 4 + 32 == 4588  # + conv (d + 2GN = 64 channels), dt/A/D, norm
    assert mamba.flops_per_token == 21 * 32 * 8 == 5376  # NeMo's scan term, 21 d N
    assert mamba.activations_per_token == 100 + 64 + 2 * 32 + 32 * 8 / 4 == 292


def test_gated_deltanet_by_hand():
    # 2 key heads and 4 value heads of 8 (qk = 16, v = 32), conv kernel 4
    gdn = gated_deltanet_counts(tiny_config("qwen3_5_moe_text"))
    in_width = 2 * 16 + 2 * 32 + 2 * 4  # q|k|v, z, b, a = 104
    assert gdn.matmul == 32 * in_width + 32 * 32 == 4352
    assert gdn.params == 4352 + 64 * 4 + 2 * 4 + 8 == 4624  # + conv (2qk + v = 64 channels), dt_bias/A_log, norm
    assert gdn.flops_per_token == 6 * (4 * 64 + 4 * 4 * 8 * 8) == 7680  # NeMo's conv and delta-rule terms
    assert gdn.activations_per_token == 104 + 64 + 2 * 32 + 4 * 8 * 8 / 64 == 236


def test_nemotron_h_parameters_and_flops_by_hand():
    cfg = tiny_config("nemotron_h")
    counts = param_counts(cfg)
    # relu² experts and MLPs have up and down only: 2 * 32 * 16 per expert
    assert (counts.expert_matmul, counts.shared_per_layer, counts.router_per_layer) == (1024, 1024, 4 * 32)
    assert counts.attention_per_layer == 32 * (32 + 2 * 16) + 32 * 32 == 3072
    assert (counts.layers, counts.attention_layers, counts.mixer_layers, counts.moe_layers) == (4, 1, 1, 2)
    assert counts.norms == (4 + 1) * 32  # one block per layer, each with its norm, and the final norm
    total = 2 * 96 * 32 + 160 + 3072 + 4588 + 2 * (128 + 1024 + 4 * 1024)
    assert counts.total == total == 24460 == _real_params(cfg)
    assert counts.active_matmul == 96 * 32 + 3072 + 4224 + 2 * (1024 + 2 * 1024) == 16512
    # S = 16: 6 x matmuls, the one attention layer's 6 * heads * (d_qk + d_v) * S/2, the Mamba2 scan
    assert flops_per_token(cfg, 16) == 6 * 16512 + 6 * 4 * 16 * 8 + 5376 == 107520


def test_qwen3_5_moe_parameters_and_flops_by_hand():
    cfg = tiny_config("qwen3_5_moe_text")
    counts = param_counts(cfg)
    # the query projection also gives the output gate (2 x 32 wide); per-head q/k norms
    assert counts.attention_per_layer == 32 * (2 * 32 + 2 * 16) + 32 * 32 + 2 * 8 == 4112
    assert counts.router_per_layer == 4 * 32 + 32  # the router and the shared expert's sigmoid gate
    assert (counts.expert_matmul, counts.shared_per_layer) == (3 * 32 * 16, 3 * 32 * 16)
    total = 2 * 96 * 32 + (2 * 2 + 1) * 32 + 4112 + 4624 + 2 * (160 + 1536 + 4 * 1536)
    assert counts.total == total == 30720 == _real_params(cfg)
    assert counts.active_matmul == 96 * 32 + 4096 + 4352 + 2 * (1536 + 2 * 1536) == 20736
    assert flops_per_token(cfg, 16) == 6 * 20736 + 6 * 4 * 16 * 8 + 7680 == 135168


def test_memory_estimate_counts_the_mixers_by_hand():
    # float32 (b = 4) on one rank, 2 x 16 tokens: the parameters' 4 copies, each layer's activations
    nemotron = tiny_config("nemotron_h")
    est = estimate_memory(nemotron, 1, 1, seq_len=16, local_batch=2, dtype="float32", device_type="cpu")
    assert est.sharded_state == 24460 * 4 * 4
    # block, the router's 4 probabilities, 2 routed relu² copies (input, up, activation and, as the combine weighs
    # the rows, output), the shared expert's up and activation
    moe = 2 * 32 + (4 + 2 * (2 * 32 + 2 * 16) + 2 * 16)
    per_layer = [2 * 32 + 292, moe, 2 * 32 + (2 * 4 * 8 + 2 * 2 * 8), moe]  # Mamba2, MoE, attention, MoE
    assert per_layer == [356, 292, 160, 292]
    assert est.activations == 32 * 4 * sum(per_layer)
    checkpointed = estimate_memory(
        nemotron, 1, 1, seq_len=16, local_batch=2, dtype="float32", device_type="cpu", activation_checkpointing=True
    )
    assert checkpointed.activations == 32 * 4 * (4 * 32 + 356)
    # two ranks: the largest layer gathered is an MoE one (router + shared + 4 experts), not the Mamba2 one
    two = estimate_memory(nemotron, 2, 1, seq_len=16, local_batch=2, dtype="float32", device_type="cpu")
    assert two.gathered == 4 * (2 * (2 * 96 * 32) + 3 * (128 + 1024 + 4096))

    qwen = tiny_config("qwen3_5_moe_text")
    est = estimate_memory(qwen, 1, 1, seq_len=16, local_batch=2, dtype="float32", device_type="cpu")
    # the router's 4 probabilities, 2 routed copies taking their weights in their rows (input, gate/up, activation),
    # the shared expert's gate/up and activation and its output, kept for its sigmoid gate
    moe = 4 + 2 * (32 + 3 * 16) + (48 + 32)
    # attention: q, k, v, output; the q/k norms' inputs; the gated query's gate half, sigmoid and gated output
    attention = (2 * 4 * 8 + 2 * 2 * 8) + (4 + 2) * 8 + 3 * 4 * 8
    assert est.activations == 32 * 4 * ((4 * 32 + 236 + moe) + (4 * 32 + attention + moe))


@pytest.mark.parametrize(
    "name, total, active, no_embed",
    # NVIDIA's card: 31.6B total, 3.6B active with the embeddings, 3.2B without
    [("nemotron-3-nano-30b-a3b", 31.6e9, 3.6e9, 3.2e9)],
)
def test_full_size_hybrid_has_the_published_sizes(name, total, active, no_embed):
    cfg = preset_config(name)
    counts = param_counts(cfg)
    assert counts.total == _real_params(cfg)
    assert abs(counts.total / total - 1) < 0.01
    assert abs(counts.active / active - 1) < 0.03 and abs((counts.active - counts.embed) / no_embed - 1) < 0.03
