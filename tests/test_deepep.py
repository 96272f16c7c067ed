"""The deepep dispatcher: selection, fallback and buffer teardown on CPU; parity with alltoall on 2 GPUs.

The GPU test needs DeepEP importable (built without NVSHMEM for intranode use; see
workbench/moe/dispatch/deepep.py) and 2 CUDA GPUs.
Script mode (2 GPUs, self-spawning): python tests/test_deepep.py --bench
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

# Script mode: import workbench from this checkout and the test helpers beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest
import torch
import torch.distributed as dist
from dispatch_compare import bench_two_gpus, random_routing, round_trip
from launch_utils import run_ranks
from torch import nn

import workbench.backends as backends
from workbench.backends import BackendConfig, BackendError, availability
from workbench.moe.dispatch import close_dispatchers, close_live_dispatchers, make_dispatcher
from workbench.moe.dispatch.deepep import BufferSlot
from workbench.moe.hf_experts import EngineExperts, engine_experts_modules

HAS_DEEP_EP = importlib.util.find_spec("deep_ep") is not None
# Multicast/NVLS off (shared/gpu notes): NCCL, torch symmetric memory and NVSHMEM each have a switch.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
needs_no_deep_ep = pytest.mark.skipif(HAS_DEEP_EP, reason="checks the not-installed path; deep_ep is installed here")


# ---------------------------------------------------------------- CPU: selection and fallback


@needs_no_deep_ep
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_deepep_without_the_package_names_the_extra(device):
    with pytest.raises(BackendError, match=r"deep_ep is not installed: pip install 'moe-workbench\[deepep\]'"):
        BackendConfig(dispatcher="deepep").resolve(device, world_size=2)


@needs_no_deep_ep
def test_constructing_without_the_package_names_the_extra():
    with pytest.raises(BackendError, match=r"moe-workbench\[deepep\].*alltoall"):
        make_dispatcher("deepep", 8, None)


@pytest.fixture
def deep_ep_installed(monkeypatch):
    """Pretend deep_ep is importable and this node has 8 GPUs (availability only looks, never imports)."""
    real = backends._has_module
    monkeypatch.setattr(backends, "_has_module", lambda name: name == "deep_ep" or real(name))
    monkeypatch.setattr(backends, "gpus_per_node", lambda: 8)


@pytest.mark.parametrize(
    "device,world_size,expected",
    [
        ("cpu", 1, "local"),
        ("cpu", 2, "alltoall"),
        ("cpu", 8, "alltoall"),
        ("cuda", 1, "local"),
        ("cuda", 2, "alltoall"),
        ("cuda", 8, "alltoall"),
    ],
)
def test_auto_never_picks_deepep(device, world_size, expected):
    assert BackendConfig(dispatcher="auto").resolve(device, world_size=world_size).dispatcher == expected


@pytest.mark.parametrize("device,world_size", [("cuda", 2), ("cuda", 8)])
def test_auto_stays_alltoall_even_when_deepep_is_usable(deep_ep_installed, device, world_size):
    assert availability("dispatcher", "deepep", device, world_size) == (True, "")
    assert BackendConfig(dispatcher="auto").resolve(device, world_size=world_size).dispatcher == "alltoall"
    assert BackendConfig(dispatcher="deepep").resolve(device, world_size=world_size).dispatcher == "deepep"


@pytest.mark.parametrize(
    "device,world_size,gpus,message",
    [
        ("cpu", 2, 8, r"needs CUDA GPUs.*got cpu; use 'alltoall'"),
        ("cuda", 1, 8, r"needs ep >= 2; use 'local'"),
        ("cuda", 3, 8, r"run on 2, 4, 8 ranks, got 3; use 'alltoall'"),
        ("cuda", 16, 8, r"run on 2, 4, 8 ranks, got 16"),
        ("cuda", 8, 4, r"intranode only \(NVLink\): 8 ranks but this node has 4 GPUs; use 'alltoall'"),
    ],
)
def test_deepep_refused_with_a_reason(deep_ep_installed, monkeypatch, device, world_size, gpus, message):
    monkeypatch.setattr(backends, "gpus_per_node", lambda: gpus)
    ok, reason = availability("dispatcher", "deepep", device, world_size)
    assert not ok
    assert re.search(message, reason), reason
    with pytest.raises(BackendError, match=message):
        BackendConfig(dispatcher="deepep").resolve(device, world_size=world_size)


@pytest.mark.parametrize(
    "nvml,visible,expected",
    [
        (8, 1, 8),  # a rank whose CUDA_VISIBLE_DEVICES shows only its own GPU: the host still has 8
        (4, 4, 4),
        (-1, 2, 2),  # NVML could not count (torch's -1): what torch sees
        (0, 0, 0),  # no GPU at all
    ],
)
def test_gpus_per_node_counts_the_host_not_the_visible_devices(monkeypatch, nvml, visible, expected):
    # The two counts stand in for hardware this CPU machine lacks; the rule between them is what is tested.
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: nvml, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert backends.gpus_per_node() == expected


def test_gpus_per_node_without_nvml_is_the_visible_count(monkeypatch):
    def no_library():
        raise RuntimeError("NVML library not found")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", no_library, raising=False)
    assert backends.gpus_per_node() == 2
    monkeypatch.delattr(torch.cuda, "_raw_device_count_nvml", raising=False)
    assert backends.gpus_per_node() == 2


@needs_no_deep_ep
def test_backend_panel_shows_deepep_missing_with_the_install_command():
    pytest.importorskip("ipywidgets")
    from workbench.ui import BackendPanel, backend_choices

    install = "pip install 'moe-workbench[deepep]'"
    for device_type in ("cpu", "cuda"):
        deepep = {c.value: c for c in backend_choices(None, device_type, 2, 2)["dispatcher"]}["deepep"]
        assert not deepep.available and install in deepep.reason, deepep
    panel = BackendPanel(None, "cpu", 2)
    button = panel.rows["dispatcher"].buttons["deepep"]
    assert button.disabled and install in button.tooltip
    # the panel's one collapsible line of unavailable choices names it with the install command
    assert any(name == "dispatcher=deepep" and install in why for name, why in panel.rows["dispatcher"].reasons)
    assert "dispatcher=deepep" in panel.unavailable.value and "moe-workbench[deepep]" in panel.unavailable.value
    assert panel.auto_resolution()["dispatcher"] == "alltoall"


# ---------------------------------------------------------------- CPU: buffer lifecycle and teardown


class FakeBuffer:
    def __init__(self, num_bytes: int, log: list):
        self.num_bytes, self.log = num_bytes, log
        log.append(("make", num_bytes))

    def destroy(self):
        self.log.append(("destroy", self.num_bytes))


def test_buffer_slot_is_lazy_grows_and_closes_once():
    log = []
    slot = BufferSlot(lambda n: (FakeBuffer(n, log), f"key{n}"))
    assert slot.close() is False and slot.key is None and log == []  # nothing held: a no-op
    first = slot.get(100)
    assert slot.get(50) is first and slot.get(100) is first and slot.key == "key100"
    second = slot.get(300)  # wider rows: the old buffer is freed first
    assert second is not first and log == [("make", 100), ("destroy", 100), ("make", 300)]
    assert slot.close() is True and slot.close() is False
    assert log[-1] == ("destroy", 300) and slot.buffer is None and slot.key is None


class FakeClosable:
    """A dispatcher that holds a buffer until close(), like DeepEPDispatcher."""

    def __init__(self, key: str | None, group_ranks=(0,)):
        self.open_key, self.group_ranks, self.closes = key, list(group_ranks), 0

    def close(self) -> bool:
        self.closes += 1
        held, self.open_key = self.open_key is not None, None
        return held


class _Experts(EngineExperts, nn.Module):
    """An engine experts module holding only its dispatcher (what the close functions look at)."""

    def __init__(self, dispatcher):
        nn.Module.__init__(self)
        self.plan = SimpleNamespace(dispatcher=dispatcher)  # the one plan field the close functions read


def _blocks(dispatchers) -> nn.Module:
    return nn.ModuleList([_Experts(d) for d in dispatchers])


def test_close_dispatchers_on_a_real_model_holding_no_buffer_is_a_no_op():
    from tiny_models import tiny_qwen3_moe

    import workbench

    model = workbench.AutoModelForCausalLM.from_config(tiny_qwen3_moe(), backend=BackendConfig(), device="cpu")
    assert engine_experts_modules(model)
    assert close_dispatchers(model) == 0
    assert close_dispatchers(model) == 0


def test_close_dispatchers_closes_each_shared_dispatcher_once_and_is_idempotent():
    shared, other = FakeClosable("a"), FakeClosable(None)
    model = _blocks([shared, shared, other, make_dispatcher("local", 8)])
    assert close_dispatchers(model) == 1
    assert shared.closes == 1 and other.closes == 1
    assert close_dispatchers(model) == 0 and shared.closes == 2  # close() itself is idempotent


def test_close_live_dispatchers_without_a_process_group_does_nothing():
    held = FakeClosable("a")
    model = _blocks([held])
    assert not dist.is_initialized()
    assert close_live_dispatchers() == 0 and held.closes == 0
    del model


def test_cluster_teardown_closes_the_buffers_of_live_models():
    """engine.shutdown_process_group (Cluster.stop/restart, rank side) frees what live models hold."""
    from workbench.cluster import engine

    held = FakeClosable("k", group_ranks=[0])
    model = _blocks([held, held])
    store = tempfile.mktemp(prefix="wb-deepep-store-")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        assert engine.shutdown_process_group() is True
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if os.path.exists(store):
            os.remove(store)
    assert held.closes == 1 and held.open_key is None
    del model


def _teardown_worker(rank, world):
    both = FakeClosable("both", group_ranks=[0, 1])  # held by both ranks: closed
    rank0_only = FakeClosable("only-0" if rank == 0 else None, group_ranks=[0, 1])  # peer lost it: skipped
    solo = FakeClosable(f"solo-{rank}", group_ranks=[rank])  # a one-rank group: closed
    model = _blocks([both, rank0_only, solo])
    closed = close_live_dispatchers()
    again = close_live_dispatchers()
    del model
    return {"closed": closed, "again": again, "both": both.closes, "rank0_only": rank0_only.closes, "solo": solo.closes}


@pytest.mark.slow
def test_close_live_dispatchers_closes_only_what_every_group_rank_holds():
    reports = run_ranks(_teardown_worker, 2)
    for report in reports:
        assert report["closed"] == 2 and report["again"] == 0, report
        assert report["both"] == 1 and report["solo"] == 1 and report["rank0_only"] == 0, report


# ---------------------------------------------------------------- 2 GPUs: parity with alltoall


def run_gpu_ranks(fn, world: int, *args, timeout: float = 300.0) -> list:
    """fn(rank, world, *args) on `world` NCCL ranks, one GPU each, multicast off."""
    return run_ranks(fn, world, *args, timeout=timeout, backend="nccl", env=GPU_ENV)


def _parity_worker(rank, world, configs, seed):
    device = torch.device("cuda", rank)
    group = dist.new_group(list(range(world)))
    report = []
    dispatchers = {}
    for num_experts, num_tokens, top_k, hidden in configs:
        if num_experts not in dispatchers:  # one of each per expert count: later configs reuse the buffer
            dispatchers[num_experts] = (
                make_dispatcher("alltoall", num_experts, group),
                make_dispatcher("deepep", num_experts, group),
            )
        reference, candidate = dispatchers[num_experts]
        g = torch.Generator().manual_seed(seed + 97 * rank + num_tokens)
        ids, weights = random_routing(num_tokens, num_experts, top_k, g, device)
        x = torch.randn(num_tokens, hidden, generator=g).to(device, torch.bfloat16)
        grad_out = torch.randn(num_tokens, hidden, generator=g).to(device, torch.bfloat16)
        scale = (torch.rand(num_experts // world, generator=g) + 0.5).to(device)
        a = round_trip(reference, x, ids, weights.to(torch.bfloat16), grad_out, scale)
        b = round_trip(candidate, x, ids, weights.to(torch.bfloat16), grad_out, scale)
        row = {
            "config": (num_experts, num_tokens, top_k, hidden),
            "rows": int(a["x_by_expert"].shape[0]),
            "tokens_per_expert": a["tokens_per_expert"].tolist(),
        }
        for name in a:
            same = tuple(a[name].shape) == tuple(b[name].shape) and a[name].dtype == b[name].dtype
            diff = float((a[name].double() - b[name].double()).abs().max()) if same and a[name].numel() else 0.0
            scale_ref = float(a[name].double().abs().max()) if a[name].numel() else 0.0
            row[name] = (same, diff, scale_ref)
        report.append(row)
    closed = [candidate.close() for _, candidate in dispatchers.values()]
    closed_again = [candidate.close() for _, candidate in dispatchers.values()]
    return {"rows": report, "closed": closed, "closed_again": closed_again}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEP_EP, reason="deep_ep is not installed (the 'deepep' extra, built for intranode use)")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="deepep parity needs 2 CUDA GPUs joined by NVLink")
def test_deepep_equals_alltoall_forward_and_backward_on_2_gpus():
    configs = [
        (8, 96, 2, 256),  # 4 experts per rank
        (8, 40, 2, 256),  # fewer tokens than the first call: the buffer is reused
        (128, 256, 8, 512),  # Qwen3-30B-A3B routing shape: 64 experts per rank
        (128, 1024, 8, 2048),  # ... and its hidden size: a larger buffer replaces the first
    ]
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; the seed is in any failure
    results = run_gpu_ranks(_parity_worker, 2, configs, seed)
    for rank, result in enumerate(results):
        assert result["closed"] == [True, True] and result["closed_again"] == [False, False], result
        for row in result["rows"]:
            where = f"seed {seed} rank {rank} {row['config']}"
            assert row["rows"] > 0
            assert max(row["tokens_per_expert"]) != min(row["tokens_per_expert"]), "routing should be uneven"
            for name in ("x_by_expert", "tokens_per_expert", "out", "grad_x", "grad_w"):
                same, diff, ref = row[name]
                assert same, f"{where} {name}: shapes or dtypes differ"
                # Rows and counts are copies in the same order: exact. Both sum per rank first;
                # DeepEP adds the per-rank partial sums in bf16, alltoall in float32.
                tol = 0.0 if name in ("x_by_expert", "tokens_per_expert") else 2e-2 * max(ref, 1.0)
                assert diff <= tol, f"{where} {name}: max |deepep - alltoall| = {diff} (reference max {ref})"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEP_EP, reason="deep_ep is not installed (the 'deepep' extra, built for intranode use)")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="deepep on the generic path needs 2 GPUs joined by NVLink")
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_generic_family_on_deepep_equals_alltoall_on_2_gpus(family):
    """The generic path's experts modules through DeepEP, DP2 x EP2, bf16; the buffer is freed by close_dispatchers."""
    from dispatch_compare import check_generic_family_grads, generic_family_grads

    results = run_gpu_ranks(generic_family_grads, 2, family, ("alltoall", "deepep"))
    check_generic_family_grads(results, "alltoall", "deepep")


# ---------------------------------------------------------------- script mode: timing table

if __name__ == "__main__":
    if "--bench" in sys.argv:
        if not HAS_DEEP_EP:
            sys.exit("--bench needs deep_ep importable (the 'deepep' extra)")
        bench_two_gpus(run_gpu_ranks, "deepep")
    else:
        sys.exit(pytest.main([__file__, "-v"]))
