"""The engine's experts return a tensor of their own, never a view: FSDP2 hooks a sharded module's output for its
pre-backward all-gather, an in-place op on a returned view would drop that hook, and torch warns about any view
returned ("returned a view tensor ... can cause backward to fail") on every rank of every multi-rank run."""

from __future__ import annotations

import torch
from generic_families import tiny_config

from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.moe.dispatch.local import weighted_sum
from workbench.moe.hf_experts import engine_experts_modules

# Shape suffixes: T tokens, D hidden, K top-k, N routed rows.


def test_engine_experts_return_no_view_in_float32():
    cfg = tiny_config("qwen3_moe")
    model = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="grouped_mm"), device="cpu")
    outputs = []
    for _, module in engine_experts_modules(model):
        module.register_forward_hook(lambda _m, _args, out: outputs.append(out))
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert outputs and all(out.dtype == torch.float32 and out._base is None for out in outputs)


def test_the_weighted_combine_returns_its_own_tensor_with_the_same_sums():
    """The combine every dispatcher's CPU path ends in (the all-to-all's sends home through it too)."""
    y_ND, weights_TK = torch.randn(12, 8), torch.rand(4, 3)
    rows = torch.arange(12)
    out_TD = weighted_sum(y_ND, weights_TK, rows, rows)
    assert out_TD._base is None
    torch.testing.assert_close(out_TD, (weights_TK.unsqueeze(-1) * y_ND.view(4, 3, 8)).sum(1))
    empty = weighted_sum(torch.zeros(0, 8), torch.zeros(0, 3), rows[:0], rows[:0])  # a rank sent no tokens
    assert empty.shape == (0, 8)
