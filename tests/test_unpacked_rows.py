"""Transformers' packed-rows check answered from the host's position ids: no read, the same masks and logits."""

from __future__ import annotations

import torch
import transformers
from generic_families import tiny_config
from transformers import masking_utils

from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.unpacked_rows import host_rows_unpacked, rows_known_unpacked
from workbench.train.host_syncs import HostSyncRecorder


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


def test_unpacked_rows_skip_the_read_with_equal_logits():
    cfg, vanilla, engine = _models()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(3, 15).expand(2, 12)  # rows need not start at 0: unpacked means every step is +1
    with torch.no_grad():
        with HostSyncRecorder(depth=8) as rec:
            want = engine(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert _packed_reads(rec) == 1  # Transformers' own check reads once per forward
        with HostSyncRecorder(depth=8) as rec, rows_known_unpacked(pos) as unpacked:
            got = engine(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert unpacked and _packed_reads(rec) == 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        hf = vanilla(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(got, hf, rtol=1e-4, atol=1e-5)


def test_packed_rows_keep_transformers_block_diagonal_mask():
    cfg, vanilla, engine = _models()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]), torch.arange(12)])  # row 0: two documents
    with torch.no_grad(), rows_known_unpacked(pos) as unpacked:
        got = engine(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert not unpacked
    with torch.no_grad():
        want = vanilla(input_ids=ids, position_ids=pos, use_cache=False).logits
        as_one_document = vanilla(input_ids=ids, position_ids=torch.arange(12).expand(2, 12), use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the second document of row 0 sees only itself: its logits differ from one long document's
    assert not torch.allclose(got[0, 5:], as_one_document[0, 5:], atol=1e-3)


def test_a_claim_answers_only_for_its_length_and_only_inside():
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with rows_known_unpacked(torch.arange(12).expand(2, 12)):
        found = masking_utils.find_packed_sequence_indices(packed)  # another length: Transformers' answer
        assert found is not None and found[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
        assert masking_utils.find_packed_sequence_indices(torch.zeros(1, 12, dtype=torch.long)) is None
    found = masking_utils.find_packed_sequence_indices(torch.zeros(1, 12, dtype=torch.long))  # after: its own
    assert found is not None and found[0].tolist() == list(range(12))


def test_host_rows_unpacked_needs_host_rows_that_step_by_one():
    assert host_rows_unpacked(torch.arange(6).expand(3, 6))
    assert not host_rows_unpacked(torch.tensor([[0, 1, 2, 0, 1, 2]]))
    assert not host_rows_unpacked(torch.tensor([[0, 1, 1, 2]]))  # a repeated position is not a step of one
    assert not host_rows_unpacked(torch.arange(6))  # not [B, S]
    assert not host_rows_unpacked(torch.arange(6, device="meta").expand(1, 6))  # a device tensor: not read here
    assert not host_rows_unpacked(None)
