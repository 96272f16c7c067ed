"""Host syncs: the recorder sees each kind, and the generic path's forward+backward issues none of its own."""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config

from workbench import BackendConfig
from workbench.kernels.cross_entropy import check_label_range
from workbench.models.attention_sinks import flash_sequences, sink_attention
from workbench.models.auto import AutoModelForCausalLM
from workbench.train.host_syncs import HostSyncRecorder

FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"]

# Reads the generic path may make, by the function they come from, each with why it is allowed.
ALLOWED = {
    # The label range check reads the labels only when they live on the CPU (free there); on a
    # device it is an asynchronous assert (test_label_check_on_a_device_reads_nothing).
    "check_label_range": lambda s: s.device == "cpu",
    # Transformers' masking_utils: without a cache or attention mask it asks whether the rows are
    # packed, `(packed_sequence_mask[:, -1] == 0).all()`, once per forward (sdpa families; the
    # position_ids it reads are the model's own arange when the caller gave none). Not the engine's.
    "find_packed_sequence_indices": lambda s: s.origin.startswith("transformers/masking_utils.py"),
    # With position_ids, the sink attention's document count (a shape of the varlen kernel's
    # cu_seqlens) is read once per forward in EngineCausalLM (test_position_ids_cost_one_read_per_forward).
    "flash_sequences": lambda s: s.origin.startswith("workbench/models/attention_sinks.py"),
}


def _function(sync) -> str:
    return sync.origin.rsplit(" ", 1)[-1]


def _not_allowed(syncs) -> list[str]:
    return [
        f"{s.op} @ {' <- '.join(reversed(s.stack))}"
        for s in syncs
        if not (_function(s) in ALLOWED and ALLOWED[_function(s)](s))
    ]


def _model(family: str):
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    cfg = tiny_config(family, **({"swiglu_limit": 0.3} if family == "gpt_oss" else {}))
    model = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(experts="grouped_mm", fused_ce=True), device="cpu", dtype=torch.float32
    )
    return cfg, model


def test_recorder_sees_each_kind_of_sync_and_nothing_else():
    x = torch.arange(6.0, requires_grad=True)
    with HostSyncRecorder() as rec:
        y = (x * 2).sum()  # plain ops: nothing to wait for
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long), output_size=6)
        y.backward()
    assert rec.syncs == []
    with HostSyncRecorder() as rec:
        x.sum().item()
        x.detach().tolist()
        x.nonzero()
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.unique(x)
        x.detach()[x.detach() > 2]
        torch.masked_select(x, x > 2)
    ops = [s.op for s in rec.syncs]
    assert ops == [
        "_local_scalar_dense",
        "tolist",
        "nonzero",
        "repeat_interleave",
        "_unique2",
        "index",
        "masked_select",
    ]
    assert all(s.origin.startswith("tests/test_host_syncs.py") and not s.from_workbench() for s in rec.syncs)


@pytest.mark.parametrize("family", FAMILIES)
def test_generic_forward_backward_issues_no_engine_sync(family):
    cfg, model = _model(family)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with HostSyncRecorder(depth=8) as rec:
        # as `workbench bench` calls it (its rows run the trainer step): the family's aux loss, no cache
        out = model(
            input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(24.0), output_router_logits=True, use_cache=False
        )
        aux = getattr(out, "aux_loss", None)
        (out.loss if aux is None else out.loss + 0.01 * aux).backward()
    assert _not_allowed(rec.syncs) == []
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # backward ran, under the mode


def test_position_ids_cost_one_read_per_forward():
    """The trainer passes position_ids: GPT-OSS's sink attention then reads the document count once, not per layer."""
    cfg, model = _model("gpt_oss")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)  # two documents per row
    with HostSyncRecorder(depth=8) as rec:
        model(input_ids=ids, labels=ids, position_ids=pos).loss.backward()
    assert _not_allowed(rec.syncs) == []
    assert cfg.num_hidden_layers > 1 and [_function(s) for s in rec.syncs].count("flash_sequences") == 1


def test_label_check_on_a_device_reads_nothing():
    """The CUDA branch of the label range check: an asynchronous assert (meta stands in for the device)."""
    labels = torch.tensor([3, -100, 7], device="meta")
    with HostSyncRecorder() as rec:
        check_label_range(labels, 8, -100)
    assert rec.syncs == []
    with pytest.raises(ValueError, match="label 8 is outside"):
        check_label_range(torch.tensor([3, -100, 8]), 8, -100)


def test_flash_sequences_unpacked_without_a_read_packed_as_before():
    with HostSyncRecorder() as rec:
        cu, bound = flash_sequences(None, 3, 5, torch.device("cpu"))
    assert rec.syncs == [] and bound == 5 and cu.dtype == torch.int32
    assert cu.tolist() == [0, 5, 10, 15]
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4], [4, 5, 0, 0, 1]])
    cu, bound = flash_sequences(pos, 3, 5, torch.device("cpu"))
    assert cu.tolist() == [0, 3, 5, 10, 12, 13, 15] and bound == 5


def test_sink_attention_given_sequences_reads_nothing_and_matches_position_ids():
    """What EngineCausalLM hands each layer: no read there, same output as finding the documents per layer."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 8, generator=g) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    sequences = flash_sequences(pos, 2, 6, q.device)
    for window in (None, 2):
        with HostSyncRecorder() as rec:
            got = sink_attention(q, k, v, sinks, 0.35, window, sequences=sequences)
        assert rec.syncs == []
        want = sink_attention(q, k, v, sinks, 0.35, window, position_ids=pos, kernel="reference")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
