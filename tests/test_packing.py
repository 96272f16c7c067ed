"""Packed rows keep their documents apart on every attention backend: per-document losses equal unpacked runs.

A row packs documents of different lengths with position_ids restarting at 0 per document (train/data.py).
Each document's per-token cross-entropy in the packed row must equal the document run alone; the earlier
documents' embeddings must get no gradient from a later document's loss; and, so that these checks can
fail, the same row with position_ids not restarting (plain causal attention across documents) must differ.
CPU: float32, every backend that runs here. GPU (cuDNN SDPA, TE, the sinks' varlen flash, fused RoPE): the
same checks in bf16, skipped here with the reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from generic_families import tiny_config
from test_generic_families import randomize

from workbench import BackendConfig
from workbench.backends import te_availability
from workbench.models.attention_sinks import SINK_ATTENTION
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.engine_state import engine_state
from workbench.train.data_batch import IGNORE_INDEX, Batch, pack_examples

LENGTHS = (7, 12, 5)  # three documents of different lengths in one row of 24
EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.bfloat16: 2.0**-8}
CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not CUDA, reason="CUDA-only backend: needs a GPU (torch sees none here)")


def _tol(dtype: torch.dtype, scale: float) -> float:
    """fp32: rounding of sums of a few hundred terms; bf16: 4 units of its last place (<= 1.6 measured on CPU)."""
    return (512 if dtype == torch.float32 else 4) * EPS[dtype] * max(scale, 1.0)


def _config(family: str, device: str):
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    # head dim 64 on CUDA: what cuDNN, flash and TE take (the CPU kernels take any)
    wide = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64) if device == "cuda" else {}
    if family == "deepseek_v3" and wide:
        wide.update(num_key_value_heads=2, head_dim=32, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64)
    return tiny_config(family, **wide)


def _engine(family: str, attention: str, device: str = "cpu", dtype=torch.float32, **backend):
    """The engine's model of a tiny `family` with BackendConfig.attention=`attention`, fresh large weights."""
    cfg = _config(family, device)
    model = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(attention=attention, **backend), device=device, dtype=dtype
    )
    randomize(model)  # weights large enough that attending across documents moves the loss far past rounding
    return model.eval()


def _documents(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _positions(docs, restart: bool = True) -> torch.Tensor:
    if not restart:
        return torch.arange(sum(len(d) for d in docs))
    return torch.cat([torch.arange(len(d)) for d in docs])


def _token_ce(model, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [S - 1] of one row (entry t: token t + 1 predicted from tokens .. t), float32."""
    dev = model.device
    logits = model(input_ids=ids[None].to(dev), position_ids=position_ids[None].to(dev), use_cache=False).logits
    return F.cross_entropy(logits[0, :-1].float(), ids[1:].to(dev), reduction="none")


def _split(ce: torch.Tensor, docs) -> list[torch.Tensor]:
    """A packed row's token CE per document: its own L - 1 predictions (not the one across the boundary)."""
    out, start = [], 0
    for d in docs:
        out.append(ce[start : start + len(d) - 1])
        start += len(d)
    return out


def check_isolation(model, what: str) -> None:
    """Packed == unpacked per document; no gradient across documents; a non-restarting row differs."""
    dtype = next(model.parameters()).dtype
    docs = _documents(model.config.vocab_size)
    packed = _split(_token_ce(model, torch.cat(docs), _positions(docs)), docs)
    alone = [_token_ce(model, d, _positions([d])) for d in docs]
    scale = max(a.abs().max().item() for a in alone)
    tol = _tol(dtype, scale)
    worst = 0.0
    for i, (p, a) in enumerate(zip(packed, alone)):
        diff = (p - a).abs().max().item()
        worst = max(worst, diff)
        assert diff <= tol, f"{what}: document {i} packed vs alone: max |diff| of token CE {diff:.3g} > {tol:.3g}"
    # the control: attending across documents (positions not restarting) moves later documents' CE by far more.
    # bf16's tol is 4 units of the CE's last place; a leak through a hybrid's decaying mixer state moved CE by 4.4 tol
    # on an H100 (2026-12-06), so in bf16 the leak must stand 4x clear of the packing's own rounding instead.
    leaky = _split(_token_ce(model, torch.cat(docs), _positions(docs, restart=False)), docs)
    moved = max((p - a).abs().max().item() for p, a in zip(leaky[1:], alone[1:]))
    floor = 8 * tol if dtype == torch.float32 else max(2 * tol, 4 * worst)
    assert moved > floor, (
        f"{what}: cross-document attention moves CE by only {moved:.3g} (tol {tol:.3g}, worst {worst:.3g})"
    )
    # backward: the last document's loss reaches no earlier token's embedding
    ids = torch.cat(docs)[None].to(model.device)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=emb, position_ids=_positions(docs)[None].to(model.device), use_cache=False).logits
    first = len(ids[0]) - len(docs[-1])
    F.cross_entropy(logits[0, first:-1].float(), ids[0, first + 1 :]).backward()
    own = emb.grad[0, first:].abs().max().item()
    leak = emb.grad[0, :first].abs().max().item()
    assert own > 0 and leak <= _tol(dtype, 1.0) * own, f"{what}: gradient across documents {leak:.3g} (own {own:.3g})"


# ---------------------------------------------------------------- CPU, float32

CPU_CASES = [  # every BackendConfig.attention that runs on the CPU (the engine offers no "eager")
    ("qwen3_moe", "sdpa"),  # the engine's Qwen3-MoE path (its attention module; rope='torch' on the CPU)
    ("mixtral", "sdpa"),  # Transformers' sdpa with its block-diagonal mask
    ("deepseek_v3", "sdpa"),  # MLA attention through Transformers' sdpa
    ("gpt_oss", "sdpa"),  # 'auto'/'sdpa' resolves to the engine's sink attention for GPT-OSS (CPU kernel)
    ("gpt_oss", "sinks"),
]


@pytest.mark.parametrize("family,attention", CPU_CASES)
def test_packed_documents_equal_unpacked_on_cpu(family, attention):
    model = _engine(family, attention)
    if family == "gpt_oss":
        assert model.config._attn_implementation == SINK_ATTENTION
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*workbench_sinks.*eager math.*")  # the fused CPU kernel runs
        check_isolation(model, f"{family}/{attention}")


# ---------------------------------------------------------------- CUDA, bf16 (run by the lead on the GPU)


@NEEDS_CUDA
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_cudnn_first_sdpa_keeps_documents_apart(family):
    """attention='sdpa' on CUDA: the engine's SDPA priority (cuDNN first); Qwen3-MoE with the fused Triton RoPE."""
    model = _engine(family, "sdpa", "cuda", torch.bfloat16)
    if family == "qwen3_moe":
        from workbench.models.families.qwen3_moe.attention import Qwen3MoeEngineAttention

        assert engine_state(model).backend.rope == "triton"
        assert any(isinstance(m, Qwen3MoeEngineAttention) for m in model.modules())
    check_isolation(model, f"{family}/sdpa cuDNN first")


@NEEDS_CUDA
def test_cudnn_sdpa_alone_keeps_documents_apart():
    """Transformers' sdpa pinned to the cuDNN kernel only: the block-diagonal mask itself is honoured by cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = _config("mixtral", "cuda")
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    randomize(model)
    model = model.cuda().eval()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        try:
            check_isolation(model, "mixtral/cuDNN only")
        except RuntimeError as err:
            if "No available kernel" not in str(err):
                raise
            pytest.skip(
                f"cuDNN SDPA refuses this call on this machine ({err}); the engine's priority list then "
                "runs flash/efficient/math (test_cudnn_first_sdpa_keeps_documents_apart)"
            )


@pytest.mark.skipif(not te_availability("cuda")[0], reason=f"TE attention: {te_availability('cuda')[1]}")
def test_te_attention_keeps_documents_apart():
    """attention='te': packed rows (a mask) fall back to SDPA, recorded on the module; single documents run TE."""
    from workbench.kernels.te_attention import FALLBACK_ATTR

    model = _engine("qwen3_moe", "te", "cuda", torch.bfloat16)
    check_isolation(model, "qwen3_moe/te")
    attn = model.model.layers[0].self_attn
    docs = _documents(model.config.vocab_size)
    _token_ce(model, docs[0], _positions([docs[0]]))
    assert attn.__dict__[FALLBACK_ATTR] is None  # one document: TE's own causal kernel ran
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _token_ce(model, torch.cat(docs), _positions(docs))
    assert "packed" in attn.__dict__[FALLBACK_ATTR]


@NEEDS_CUDA
def test_sink_attention_varlen_flash_keeps_documents_apart():
    """GPT-OSS on CUDA: the engine's sink attention through the varlen flash kernel (cu_seqlens per document)."""
    model = _engine("gpt_oss", "sinks", "cuda", torch.bfloat16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*workbench_sinks.*eager math.*")  # flash runs, not the fallback
        check_isolation(model, "gpt_oss/sinks flash")


# ---------------------------------------------------------------- the trainer's batches


def _rows_documents(batch: Batch) -> list[tuple[int, int, int]]:
    """(row, start, length) of every document holding loss tokens, from position_ids restarting at 0."""
    out = []
    for r in range(len(batch)):
        starts = (batch.position_ids[r] == 0).nonzero().flatten().tolist() + [batch.position_ids.shape[1]]
        for s, e in zip(starts[:-1], starts[1:]):
            if (batch.labels[r, s + 1 : e] != IGNORE_INDEX).any():
                out.append((r, s, e - s))
    return out


def check_engine_loss_per_document(model, batch: Batch, forward_extra, what: str) -> int:
    """The engine's loss on one document of a packed batch (labels masked to it) == on that document alone."""
    checked = 0
    for r, s, n in _rows_documents(batch):
        labels = torch.full_like(batch.labels, IGNORE_INDEX)
        labels[r, s : s + n] = batch.labels[r, s : s + n]
        packed = model(
            input_ids=batch.input_ids,
            labels=labels,
            position_ids=batch.position_ids,
            use_cache=False,
            **forward_extra(batch),
        ).loss
        doc = Batch(*(t[r : r + 1, s : s + n] for t in (batch.input_ids, batch.labels, batch.position_ids)))
        alone = model(
            input_ids=doc.input_ids,
            labels=doc.labels,
            position_ids=doc.position_ids,
            use_cache=False,
            **forward_extra(doc),
        ).loss
        tol = _tol(torch.float32, alone.abs().item())
        assert (packed - alone).abs().item() <= tol, (
            f"{what}: row {r} document at {s} (+{n}): packed loss {packed.item():.6g} != alone {alone.item():.6g}"
        )
        checked += 1
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_trainer_packed_batch_per_document_loss_equals_unpacked(family, tmp_path):
    """The Trainer's own model, data stream (shipped JSONL, pack=True) and forward kwargs (GPT-OSS: the host's
    cu_seq_lens): each document's loss in the packed micro-batch equals its loss run alone."""
    from workbench.config import TINY_VOCAB_SIZE, ModelConfig, RunConfig
    from workbench.train.loop import Trainer

    model = ModelConfig(dtype="float32", device="cpu")
    if family != "qwen3_moe":  # a saved tiny checkpoint with the shipped tokenizer's vocabulary
        cfg = tiny_config(family, vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=64)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
        model = ModelConfig(preset=None, path=str(tmp_path / "m"), dtype="float32", device="cpu")
    rc = RunConfig.demo(
        model=model,
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        data__pack=True,
        train__global_batch_size=4,
        train__local_batch_size=4,
        train__save_final_checkpoint=False,
    )
    trainer = Trainer(rc)
    trainer.setup()
    randomize(trainer.model)
    trainer.model.eval()
    if family == "gpt_oss":
        assert trainer._sequences(trainer.stream.next_batch(1))  # the trainer hands the kernel its documents
    batch = trainer.stream.next_batch(rc.train.global_batch_size)
    docs = _rows_documents(batch)
    assert max(sum(1 for d in docs if d[0] == r) for r in range(len(batch))) >= 2, "no row packs two documents"
    with torch.no_grad():
        checked = check_engine_loss_per_document(trainer.model, batch, trainer._sequences, f"trainer/{family}")
    assert checked == len(docs) >= 4


@pytest.mark.parametrize("family,attention", [("qwen3_moe", "sdpa"), ("gpt_oss", "sinks")])
def test_packed_plain_text_takes_no_loss_across_documents(family, attention):
    """Documents trained on every token (plain text): the packed row's loss has no term predicting a document's
    first token from the previous document (pack_examples masks each document's first label)."""
    model = _engine(family, attention)
    docs = _documents(model.config.vocab_size, seed=3)
    batch = pack_examples([(d.tolist(), d.tolist()) for d in docs], seq_len=sum(LENGTHS) + 3, pad_id=0)
    assert len(batch) == 1 and (batch.position_ids[0] == 0).sum() == len(docs) + 1  # + the padding's own
    with torch.no_grad():
        assert check_engine_loss_per_document(model, batch, lambda b: {}, f"{family}/text") == len(docs)
    assert batch.num_loss_tokens() == sum(n - 1 for n in LENGTHS)
