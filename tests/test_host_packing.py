"""Transformers' packed-rows check answered from the host's position ids: no read, the same masks and logits."""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from transformers import masking_utils

from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.host_packing import document_index, host_packing, host_rows_packed
from workbench.train.host_syncs import HostSyncRecorder

ONE_DOCUMENT = torch.arange(3, 15).expand(2, 12)  # rows need not start at 0: unpacked means every step is +1
TWO_IN_ROW_0 = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]), torch.arange(12)])


def _packed_reads(rec: HostSyncRecorder) -> int:
    return sum(s.origin.endswith("find_packed_sequence_indices") for s in rec.syncs)


def _models(family: str = "qwen3_moe"):
    torch.manual_seed(0)
    cfg = tiny_config(family)
    vanilla = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    engine = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(experts="grouped_mm"), device="cpu", dtype=torch.float32
    ).eval()
    engine.load_state_dict(vanilla.state_dict(), strict=False)
    return cfg, vanilla, engine


@pytest.mark.parametrize("pos", [ONE_DOCUMENT, TWO_IN_ROW_0], ids=["unpacked", "packed"])
def test_host_answer_skips_the_read_with_transformers_logits(pos):
    cfg, vanilla, engine = _models()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with HostSyncRecorder(depth=8) as rec:
            want = engine(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert _packed_reads(rec) == 1  # Transformers' own check reads once per forward
        with HostSyncRecorder(depth=8) as rec, host_packing(pos) as packed:
            got = engine(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert packed == (pos is TWO_IN_ROW_0) and _packed_reads(rec) == 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        hf = vanilla(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(got, hf, rtol=1e-4, atol=1e-5)


def test_packed_rows_keep_the_block_diagonal_mask():
    cfg, vanilla, engine = _models()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), host_packing(TWO_IN_ROW_0):
        got = engine(input_ids=ids, position_ids=TWO_IN_ROW_0, use_cache=False).logits
    with torch.no_grad():
        as_one_document = vanilla(input_ids=ids, position_ids=torch.arange(12).expand(2, 12), use_cache=False).logits
    # the second document of row 0 sees only itself: its logits differ from one long document's; row 1 does not
    assert not torch.allclose(got[0, 5:], as_one_document[0, 5:], atol=1e-3)
    torch.testing.assert_close(got[1], as_one_document[1], rtol=1e-4, atol=1e-5)


def test_the_document_index_is_transformers_own():
    # Transformers' function itself, under the engine's wrapper where a test has installed it
    original = getattr(
        masking_utils.find_packed_sequence_indices, "__wrapped__", masking_utils.find_packed_sequence_indices
    )
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        lengths = torch.randint(1, 6, (16,), generator=g).tolist()  # at least 16 tokens
        row = torch.cat([torch.arange(n) + int(torch.randint(0, 3, (1,), generator=g)) for n in lengths])[:16]
        pos = torch.stack([row, torch.arange(16)])
        want = original(pos)
        assert want is not None and torch.equal(document_index(pos), want)


def test_a_claim_answers_only_for_its_length_and_only_inside():
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with host_packing(torch.arange(12).expand(2, 12)):
        found = masking_utils.find_packed_sequence_indices(packed)  # another length: Transformers' answer
        assert found is not None and found[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
        assert masking_utils.find_packed_sequence_indices(torch.zeros(1, 12, dtype=torch.long)) is None
    found = masking_utils.find_packed_sequence_indices(torch.zeros(1, 12, dtype=torch.long))  # after: its own
    assert found is not None and found[0].tolist() == list(range(12))


def test_host_rows_packed_needs_host_rows():
    assert host_rows_packed(torch.arange(6).expand(3, 6)) is False
    assert host_rows_packed(torch.tensor([[0, 1, 2, 0, 1, 2]])) is True
    assert host_rows_packed(torch.tensor([[0, 1, 1, 2]])) is True  # a repeated position restarts a document
    assert host_rows_packed(torch.arange(6)) is None  # not [B, S]
    assert host_rows_packed(torch.arange(6, device="meta").expand(1, 6)) is None  # a device tensor: not read here
    assert host_rows_packed(None) is None
