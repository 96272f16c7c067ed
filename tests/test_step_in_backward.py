"""AdamW inside backward equals AdamW after backward, and frees each gradient on the way."""

from __future__ import annotations

import copy

import pytest
import torch

import workbench
from tiny_models import tiny_qwen3_moe
from workbench.train.optim import TritonAdamW
from workbench.train.step_in_backward import StepInBackward


def _model(device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = workbench.AutoModelForCausalLM.from_config(tiny_qwen3_moe(), dtype=dtype)
    return model.to(device).train()


def _train(model, ids, steps: int, in_backward: str | None) -> list[float]:
    opt = TritonAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    hooks = None if in_backward is None else StepInBackward(opt, side_stream=in_backward == "side")
    losses, freed = [], []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if hooks is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            freed.append(all(p.grad is None for p in model.parameters()))
            hooks.finish()
        losses.append(loss.item())
    if hooks is not None:
        assert all(freed), "every gradient is freed by its update"
        hooks.remove()
    return losses


@pytest.mark.parametrize("device,dtype,stream", [
    ("cpu", torch.float32, "same"),
    pytest.param("cuda", torch.bfloat16, "same", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")),
    pytest.param("cuda", torch.bfloat16, "side", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")),
])
def test_updates_in_backward_equal_the_optimizer_step(device, dtype, stream):
    base = _model(device, dtype)
    other = copy.deepcopy(base)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    ref = _train(base, ids, 4, None)
    got = _train(other, ids, 4, stream)
    assert ref[0] != ref[-1], "the run trains"
    assert got == ref
    for (name, a), b in zip(base.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name


def test_refuses_other_optimizers_and_unhooks():
    model = _model("cpu", torch.float32)
    with pytest.raises(TypeError, match="needs a TritonAdamW"):
        StepInBackward(torch.optim.AdamW(model.parameters()))
    hooks = StepInBackward(TritonAdamW(model.parameters()))
    hooks.remove()
    ids = torch.randint(0, 128, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
