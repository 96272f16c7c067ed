"""Data: chat-template masking, packing, malformed rows, the resumable stream."""

import json

import pytest
import torch

from workbench.config import TINY_SFT_PATH, TINY_VOCAB_SIZE, TOKENIZER_DIR, DataConfig, preset_config
from workbench.errors import DataError
from workbench.train.data import TokenStream, build_stream
from workbench.train.data_batch import IGNORE_INDEX, pack_examples
from workbench.train.data_files import max_row_bytes
from workbench.train.data_messages import load_sft_examples, tokenize_messages
from workbench.train.data_tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


def _write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_shipped_tokenizer_matches_tiny_vocab(tok):
    assert len(tok) == TINY_VOCAB_SIZE
    assert tok.pad_token_id is not None and tok.eos_token == "<|im_end|>"


def test_prompt_is_masked_and_response_is_trained(tok):
    msgs = [{"role": "user", "content": "What is 7 plus 5?"}, {"role": "assistant", "content": "7 plus 5 is 12."}]
    ids, labels = tokenize_messages(tok, msgs, "row")
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(ids) == full
    trained = [i for i, l in zip(ids, labels) if l != IGNORE_INDEX]
    assert tok.decode(trained) == "7 plus 5 is 12.<|im_end|>\n"
    first = next(k for k, l in enumerate(labels) if l != IGNORE_INDEX)
    assert tok.decode(ids[:first]) == tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert all(l == IGNORE_INDEX for l in labels[:first])


def test_multi_turn_trains_every_assistant_turn_only(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye now."},
    ]
    ids, labels = tokenize_messages(tok, msgs, "row")
    trained = tok.decode([i for i, l in zip(ids, labels) if l != IGNORE_INDEX])
    assert trained == "Hello.<|im_end|>\nBye now.<|im_end|>\n"


def test_packing_keeps_examples_whole_and_resets_positions(tok, tmp_path):
    examples = load_sft_examples(TINY_SFT_PATH, tok, max_length=64)
    packed = pack_examples(examples, seq_len=64, pad_id=tok.pad_token_id, pack=True)
    unpacked = pack_examples(examples, seq_len=64, pad_id=tok.pad_token_id, pack=False)
    assert len(unpacked) == len(examples) > len(packed) * 1.5
    # Every example appears once, contiguously, starting at position 0, in file order.
    starts = []
    for row in range(len(packed)):
        pos = packed.position_ids[row]
        starts += [(row, int(k)) for k in torch.nonzero(pos == 0).flatten()]
    flat = []
    for row in range(len(packed)):
        ids, pos = packed.input_ids[row].tolist(), packed.position_ids[row].tolist()
        cuts = [k for k, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(cuts, cuts[1:]):
            flat.append(ids[a:b])
    real = [seg for seg in flat if any(t != tok.pad_token_id for t in seg)]
    assert real == [e[0] for e in examples]
    assert (packed.labels[packed.input_ids == tok.pad_token_id] == IGNORE_INDEX).all()
    assert packed.num_loss_tokens() == sum(sum(l != IGNORE_INDEX for l in e[1]) for e in examples) - sum(
        int(packed.labels[r, 0] != IGNORE_INDEX) for r in range(len(packed))
    )


def test_packed_attention_does_not_cross_examples(tok):
    """Transformers turns reset position_ids into a block-diagonal mask: doc B alone == doc B packed.

    Only without a KV cache (use_cache=False, as the trainer calls the model).
    """
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(preset_config("tiny")).eval()
    examples = load_sft_examples(TINY_SFT_PATH, tok, max_length=64)[:2]
    packed = pack_examples(examples, seq_len=128, pad_id=tok.pad_token_id)
    n_a, n_b = len(examples[0][0]), len(examples[1][0])
    with torch.no_grad():
        both = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[
            0, n_a : n_a + n_b
        ]
        alone = model(input_ids=torch.tensor([examples[1][0]]), use_cache=False).logits[0]
    torch.testing.assert_close(both, alone, rtol=1e-5, atol=1e-5)


def test_missing_field_names_file_and_line(tok, tmp_path):
    path = _write(tmp_path, [{"prompt": "a", "response": "b"}, "", {"prompt": "only a prompt"}])
    with pytest.raises(DataError) as info:
        load_sft_examples(path, tok, 64)
    assert f"{path}:3" in str(info.value) and "response" in str(info.value)


def test_bad_json_names_line(tok, tmp_path):
    path = _write(tmp_path, [{"prompt": "a", "response": "b"}, '{"prompt": "x", "response": '])
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        load_sft_examples(path, tok, 64)


def test_messages_without_assistant(tok, tmp_path):
    path = _write(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=rf"{path}:1: no assistant message"):
        load_sft_examples(path, tok, 64)


def test_row_over_max_length(tok, tmp_path):
    path = _write(tmp_path, [{"prompt": "a", "response": "b"}, {"prompt": "cat " * 80, "response": "dog"}])
    with pytest.raises(DataError) as info:
        load_sft_examples(path, tok, 32)
    msg = str(info.value)
    assert f"{path}:2" in msg and "max_length=32" in msg


def test_stream_is_deterministic_resumable_and_sliced_by_rank():
    cfg = DataConfig(kind="jsonl", seq_len=64)
    a, b = build_stream(cfg, seed=3, vocab_size=TINY_VOCAB_SIZE), build_stream(cfg, seed=3, vocab_size=TINY_VOCAB_SIZE)
    first = [a.next_batch(8).input_ids for _ in range(3)]
    assert all(torch.equal(x, b.next_batch(8).input_ids) for x in first)
    state = a.state_dict()
    nxt = a.next_batch(8)
    c = build_stream(cfg, seed=3, vocab_size=TINY_VOCAB_SIZE)
    c.load_state_dict(state)
    assert torch.equal(c.next_batch(8).input_ids, nxt.input_ids)
    # Rank slices of one global batch concatenate to that batch.
    d, e = (build_stream(cfg, seed=3, vocab_size=TINY_VOCAB_SIZE) for _ in range(2))
    d.load_state_dict(state), e.load_state_dict(state)
    halves = torch.cat([d.next_batch(8, 0, 4).input_ids, e.next_batch(8, 4, 8).input_ids])
    assert torch.equal(halves, nxt.input_ids)
    other = build_stream(cfg, seed=4, vocab_size=TINY_VOCAB_SIZE)
    assert not torch.equal(other.next_batch(8).input_ids, first[0])
    # Epochs wrap around with a new permutation; the stream never runs dry.
    many = [a.next_batch(32) for _ in range(5)]
    assert all(x.input_ids.shape == (32, 64) for x in many)


def test_synthetic_stream():
    s1 = TokenStream(None, seed=1, seq_len=16, vocab_size=100)
    s2 = TokenStream(None, seed=1, seq_len=16, vocab_size=100)
    b1, b2 = s1.next_batch(4), s2.next_batch(4)
    assert torch.equal(b1.input_ids, b2.input_ids) and torch.equal(b1.labels, b1.input_ids)
    assert b1.input_ids.max() < 100 and b1.num_loss_tokens() == 4 * 15
    assert not torch.equal(s1.next_batch(4).input_ids, b1.input_ids)


# -- bad files: named by file and line, refused before parsing or tokenizing --------------------


def test_huge_line_is_refused_by_bytes_before_parsing(tok, tmp_path):
    path = tmp_path / "huge.jsonl"
    big = max_row_bytes(64) * 4  # 4 MiB of one row: never read whole, never parsed or tokenized
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "a", "response": "b"}) + "\n")
        f.write('{"prompt": "' + "cat " * (big // 4) + '", "response": "dog"}\n')
    with pytest.raises(DataError) as info:
        load_sft_examples(path, tok, 64)
    assert str(info.value).startswith(f"{path}:2: row is over {max_row_bytes(64)} bytes")
    assert "data.max_length=64" in str(info.value)


@pytest.mark.parametrize("content", ["latin1", "binary"])
def test_non_utf8_file_names_file_and_line(tok, tmp_path, content):
    path = tmp_path / "d.jsonl"
    good = (json.dumps({"prompt": "a", "response": "b"}) + "\n").encode()
    bad = (json.dumps({"prompt": "café", "response": "b"}, ensure_ascii=False) + "\n").encode("latin-1")
    if content == "binary":
        bad = bytes(range(11, 256)) * 3  # no newline byte: one binary line
    path.write_bytes(good + good + bad)
    with pytest.raises(DataError) as info:
        load_sft_examples(path, tok, 64)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: not UTF-8") and "must be UTF-8 JSON lines" in msg


def test_utf8_cut_at_the_byte_bound_is_reported_as_too_long(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "é" * (1 << 20), "response": "b"}, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    with pytest.raises(DataError, match=rf"{path}:1: row is over"):
        load_sft_examples(path, tok, 64)


def test_empty_or_missing_tokenizer_folder(tmp_path):
    empty = tmp_path / "tok"
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text("{}")
    with pytest.raises(DataError) as info:
        load_tokenizer(empty)
    msg = str(info.value)
    assert f"tokenizer directory {empty} has no tokenizer files" in msg
    assert "tokenizer.json" in msg and "vocab.json" in msg and "'tokenizer_config.json'" in msg
    with pytest.raises(DataError, match=f"tokenizer directory {tmp_path / 'nope'} does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(DataError, match="is not a directory"):
        load_tokenizer(empty / "tokenizer_config.json")


@pytest.mark.parametrize("case", ["empty tokenizer", "missing tokenizer", "latin-1 data", "huge row"])
def test_bad_files_fail_before_the_run_directory(tmp_path, case):
    from workbench.config import RunConfig
    from workbench.train import finetune

    folder, data = tmp_path / "tok", tmp_path / "d.jsonl"
    if case == "empty tokenizer":
        folder.mkdir()
    if "tokenizer" in case:
        overrides, match = {"data__tokenizer": str(folder)}, f"tokenizer directory {folder}"
    elif case == "latin-1 data":
        data.write_bytes('{"prompt": "caf\u00e9", "response": "b"}\n'.encode("latin-1"))
        overrides, match = {"data__path": str(data)}, f"{data}:1: not UTF-8"
    else:
        data.write_text('{"prompt": "' + "x" * (2 << 20) + '", "response": "b"}\n')
        overrides, match = {"data__path": str(data)}, f"{data}:1: row is over"
    rc = RunConfig.demo(output_dir=str(tmp_path / "runs"), data__seq_len=64, train__steps=1, **overrides)
    with pytest.raises(DataError, match=match):
        finetune(rc)
    assert not (tmp_path / "runs").exists()
