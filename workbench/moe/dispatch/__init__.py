"""Token dispatch: route tokens to their experts in expert-major order, and combine back.

Every dispatcher implements one contract (moe/dispatch/contract.py: the stages dispatch -> row weights -> the
experts' GEMMs -> combine, called in that order by the engine's experts, and each dispatcher's typed
DispatcherCaps). Implementations: `local` (one rank), `alltoall`, `alltoall_overlap` (alltoall in token chunks
pipelined with the GEMMs), `symm_mem`, `deepep`.

A dispatcher that holds communication buffers (deepep) also has `close()`, collective over its
ep group and idempotent, and `open_key`, the same on every rank of that group while a buffer is
held. `close_dispatchers(model)` is for whoever owns a model; `close_live_dispatchers()` is the
rank-side teardown of a cluster, which has no model at hand.
"""

from __future__ import annotations

import torch

from workbench.moe.dispatch.alltoall import AllToAllDispatcher
from workbench.moe.dispatch.alltoall_overlap import AllToAllOverlapDispatcher
from workbench.moe.dispatch.contract import NO_CAPS, Dispatcher, DispatcherCaps, caps_of
from workbench.moe.dispatch.deepep import DeepEPDispatcher
from workbench.moe.dispatch.local import LocalDispatcher, Permutation, permute, sort_by_expert, unpermute
from workbench.moe.dispatch.symm_mem import SymmMemDispatcher


def make_dispatcher(name: str, num_experts: int, ep_group=None, combine: str = "torch", chunks: int = 2) -> Dispatcher:
    """The dispatcher called `name` (a resolved BackendConfig.dispatcher value); `combine` its kernel; `chunks`
    (BackendConfig.dispatch_chunks) the token chunks of alltoall_overlap."""
    if name == "local":
        if ep_group is not None and ep_group.size() > 1:
            raise ValueError("dispatcher='local' cannot serve expert parallelism (ep > 1); use 'alltoall'")
        return LocalDispatcher(num_experts, combine)
    if name == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group, combine)
    if name == "alltoall_overlap":
        return AllToAllOverlapDispatcher(num_experts, ep_group, combine, chunks)
    if name == "symm_mem":
        return SymmMemDispatcher(num_experts, ep_group, combine)
    if name == "deepep":
        return DeepEPDispatcher(num_experts, ep_group, combine)
    raise ValueError(f"unknown dispatcher {name!r}")


def _closable(dispatcher) -> bool:
    return callable(getattr(dispatcher, "close", None))


def model_dispatchers(model: torch.nn.Module) -> list:
    """The dispatcher of every MoE layer of `model` (its engine experts modules), in module order."""
    # hf_experts imports this package (its contract): read when called
    from workbench.moe.hf_experts import EngineExperts

    return [m.plan.dispatcher for m in model.modules() if isinstance(m, EngineExperts)]


def close_dispatchers(model: torch.nn.Module) -> int:
    """Free the buffers of every dispatcher of `model`'s MoE blocks; how many held one. Idempotent.

    Collective: every rank of each dispatcher's ep group must call it (in the same module order,
    which the same model gives). Dispatchers that hold nothing to free are skipped.
    """
    closed, seen = 0, set()
    for dispatcher in model_dispatchers(model):
        if id(dispatcher) in seen or not _closable(dispatcher):
            continue
        seen.add(id(dispatcher))
        closed += bool(dispatcher.close())
    return closed


def close_live_dispatchers() -> int:
    """Rank-side teardown: free the buffers of every MoE model still alive in this process.

    Finds the MoE blocks among live objects (also models already dropped but not yet collected),
    then agrees with the other ranks (one all_gather_object over the default group, which every
    rank must call) and closes, in key order, only the buffers every rank of their ep group still
    holds: a rank that closed or lost one makes the others skip it rather than wait forever in
    DeepEP's destroy. Returns how many buffers this rank freed; 0 without a process group.
    """
    import gc

    import torch.distributed as dist

    # hf_experts imports this package (its contract): read when called
    from workbench.moe.hf_experts import EngineExperts

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    held = {}
    for obj in gc.get_objects():
        # type(), not isinstance: some live objects (proxies) raise from __class__.
        if not issubclass(type(obj), EngineExperts):
            continue
        plan = vars(obj).get("plan")  # None on one whose install has not finished
        dispatcher = plan.dispatcher if plan is not None else None
        if _closable(dispatcher):
            key = getattr(dispatcher, "open_key", None)
            if key is not None:
                held[key] = dispatcher
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(held))
    keys_of_rank = [set(keys or ()) for keys in everyone]
    closed = 0
    for key in sorted(held):
        dispatcher = held[key]
        ranks = getattr(dispatcher, "group_ranks", range(len(everyone)))
        if all(key in keys_of_rank[r] for r in ranks):
            closed += bool(dispatcher.close())
    return closed


__all__ = [
    "NO_CAPS",
    "Dispatcher",
    "DispatcherCaps",
    "LocalDispatcher",
    "Permutation",
    "caps_of",
    "close_dispatchers",
    "close_live_dispatchers",
    "make_dispatcher",
    "model_dispatchers",
    "permute",
    "sort_by_expert",
    "unpermute",
]
