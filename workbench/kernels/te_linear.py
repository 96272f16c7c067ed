"""linear='te': nn.Linear -> te.pytorch.Linear holding the very same Parameter objects.

te.Linear reads `self.weight` (and `self.bias`) at every forward, so a Parameter assigned after
construction is what it multiplies by, and FSDP2, which re-registers parameters on the owning
module, keeps working. The one change a plain te.Linear would make to the state dict is an
`_extra_state` entry (its FP8 scaling history); TELinear drops it, so state dict keys stay
Transformers' and checkpoints still load into vanilla Transformers, vLLM and SGLang.
"""

from __future__ import annotations

import functools

from torch import nn

from workbench.kernels import te_common


@functools.cache
def te_linear_class() -> type:
    """te.pytorch.Linear without `_extra_state` in state dicts (built once, TE imported lazily)."""
    te = te_common.import_te("linear")

    class TELinear(te.Linear):
        """te.pytorch.Linear whose state dict holds only `weight` (and `bias`), like nn.Linear."""

        # nn.Module.state_dict / load_state_dict add or expect `_extra_state` only when a class
        # overrides these two; pointing them back at nn.Module's removes the entry both ways.
        # The FP8 path (te_common.fp8_autocast) keeps no state that would need it.
        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

    return TELinear


def to_te_linear(linear: nn.Linear) -> nn.Module:
    """A TELinear computing `linear`, sharing its weight (and bias) Parameter objects."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"to_te_linear takes a torch.nn.Linear, got {type(linear).__name__}")
    cls = te_linear_class()
    has_bias = linear.bias is not None
    # Built on "meta" (the string: te.Linear tests `device == "meta"` to defer its own init), so
    # nothing is allocated or initialized; its placeholders are then replaced by ours.
    new = cls(linear.in_features, linear.out_features, bias=has_bias, params_dtype=linear.weight.dtype, device="meta")
    new.weight = linear.weight
    if has_bias:
        new.bias = linear.bias
    new.train(linear.training)
    return new


def swap_linears(parent: nn.Module) -> int:
    """Replace every direct nn.Linear child of `parent` by a TELinear; returns how many."""
    swapped = 0
    for name, child in list(parent.named_children()):
        if type(child) is nn.Linear:
            setattr(parent, name, to_te_linear(child))
            swapped += 1
    return swapped
