"""data.kind='datasets': local files in each row format, chat-template labels, the tokenized cache, bad data."""

import shutil

import pytest
import torch

datasets = pytest.importorskip("datasets")

from workbench.config import TINY_VOCAB_SIZE, TOKENIZER_DIR, ConfigError, DataConfig, RunConfig  # noqa: E402
from workbench.errors import DataError  # noqa: E402
from workbench.train import data_cache  # noqa: E402
from workbench.train.data import build_stream  # noqa: E402
from workbench.train.data_batch import IGNORE_INDEX  # noqa: E402
from workbench.train.data_messages import tokenize_messages  # noqa: E402
from workbench.train.data_tokenizer import load_tokenizer  # noqa: E402

N = 12
ROWS = {
    "messages": {
        "messages": [
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"add {i} and 2"},
                {"role": "assistant", "content": f"{i + 2}"},
                {"role": "user", "content": "sure?"},
                {"role": "assistant", "content": f"yes, {i + 2}"},
            ]
            for i in range(N)
        ]
    },
    "prompt_completion": {
        "prompt": [f"what is {i} plus 1?" for i in range(N)],
        "completion": [f"{i} plus 1 is {i + 1}." for i in range(N)],
    },
    "instruction": {
        "instruction": [f"count to {i}" for i in range(N)],
        "input": ["" if i % 2 else "fast" for i in range(N)],
        "output": [" ".join(str(k) for k in range(i + 1)) for i in range(N)],
    },
    "text": {"text": [f"the number {i} comes after {i - 1} and before {i + 1}." for i in range(N)]},
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


def _save(tmp_path, rows, kind, name="d"):
    ds = datasets.Dataset.from_dict(rows)
    if kind == "save_to_disk":
        ds.save_to_disk(str(tmp_path / name))
        return {"path": str(tmp_path / name)}
    path = tmp_path / f"{name}.{kind}"
    {"parquet": ds.to_parquet, "json": ds.to_json, "jsonl": ds.to_json, "csv": ds.to_csv}[kind](str(path))
    return {"data_files": str(path)}


def _cfg(tmp_path, **kw):
    base = dict(kind="datasets", seq_len=96, pack=False, cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return DataConfig(**base)


def _expected(tok, fmt, i):
    """(ids, labels) of row i, built directly from the row and the tokenizer."""
    if fmt == "text":
        ids = tok(ROWS["text"]["text"][i], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return ids, ids
    r = {k: v[i] for k, v in ROWS[fmt].items()}
    if fmt == "messages":
        msgs = r["messages"]
    elif fmt == "prompt_completion":
        msgs = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
    else:
        prompt = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": r["output"]}]
    return tokenize_messages(tok, msgs, "test")


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "json", "csv"])
@pytest.mark.parametrize("fmt", list(ROWS))
def test_each_row_format_from_each_file_format(tok, tmp_path, kind, fmt):
    if kind == "csv" and fmt == "messages":
        pytest.skip("csv holds no nested messages")
    stream = build_stream(_cfg(tmp_path, **_save(tmp_path, ROWS[fmt], kind)), seed=0, vocab_size=TINY_VOCAB_SIZE)
    seqs = stream.sequences
    assert len(seqs) == N  # pack=False: one row per sequence, in file order
    for i in (0, N - 1):
        ids, labels = _expected(tok, fmt, i)
        b = seqs.slice(i, i + 1)
        assert b.input_ids[0, : len(ids)].tolist() == ids
        assert b.labels[0, : len(ids)].tolist() == labels
        assert (b.labels[0, len(ids) :] == IGNORE_INDEX).all()
        assert b.position_ids[0, : len(ids)].tolist() == list(range(len(ids)))


def test_assistant_only_labels_follow_the_chat_template_token_by_token(tok, tmp_path):
    cfg = _cfg(tmp_path, **_save(tmp_path, ROWS["messages"], "parquet"))
    b = build_stream(cfg, seed=0, vocab_size=TINY_VOCAB_SIZE).sequences.slice(3, 4)
    msgs = ROWS["messages"]["messages"][3]
    full = tok.apply_chat_template(msgs, tokenize=False)
    # The trained characters: each assistant turn after its generation prompt, through its end-of-turn.
    spans = [
        (
            len(tok.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=True)),
            len(tok.apply_chat_template(msgs[: k + 1], tokenize=False)),
        )
        for k, m in enumerate(msgs)
        if m["role"] == "assistant"
    ]
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    n = len(enc["input_ids"])
    assert b.input_ids[0, :n].tolist() == enc["input_ids"]
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        trained = any(a <= s and e <= z for a, z in spans)
        assert (b.labels[0, t].item() != IGNORE_INDEX) == trained, (t, full[s:e])
        if trained:
            assert b.labels[0, t].item() == enc["input_ids"][t]
    assert 0 < sum(z - a for a, z in spans) < len(full)
    every = build_stream(
        _cfg(tmp_path, assistant_only_loss=False, path=cfg.path, data_files=cfg.data_files),
        seed=0,
        vocab_size=TINY_VOCAB_SIZE,
    ).sequences.slice(3, 4)
    assert every.labels[0, :n].tolist() == enc["input_ids"]


def test_packing_and_eval_holdout(tmp_path):
    cfg = _cfg(tmp_path, pack=True, eval_fraction=0.25, eval_every=1, **_save(tmp_path, ROWS["text"], "parquet"))
    stream = build_stream(cfg, seed=0, vocab_size=TINY_VOCAB_SIZE)
    train, held = stream.sequences, stream.eval_sequences

    # a document starts at position 0 and trains on its next token (a packed one's own first label is -100)
    def docs(s):
        rows = s.slice(0, len(s))
        return int((rows.position_ids[:, :-1] == 0).logical_and(rows.labels[:, 1:] != IGNORE_INDEX).sum())

    assert len(train) < 9 and docs(train) == 9 and docs(held) == 3  # 12 rows: 9 packed for training, 3 held out
    own = _save(tmp_path, {"text": ROWS["text"]["text"][:5]}, "csv", name="eval")["data_files"]
    cfg = _cfg(tmp_path, pack=True, eval_files=[own], eval_every=1, **_save(tmp_path, ROWS["text"], "parquet"))
    stream = build_stream(cfg, seed=0, vocab_size=TINY_VOCAB_SIZE)
    assert docs(stream.sequences) == 12 and docs(stream.eval_sequences) == 5  # eval rows from their own file


def test_cache_is_hit_on_the_second_build(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, **_save(tmp_path, ROWS["prompt_completion"], "parquet"))
    first = build_stream(cfg, seed=0, vocab_size=TINY_VOCAB_SIZE).sequences

    def refuse(*a, **k):
        raise AssertionError("the tokenizer was loaded on a cache hit")

    monkeypatch.setattr(data_cache, "load_tokenizer", refuse)
    second = build_stream(cfg, seed=0, vocab_size=TINY_VOCAB_SIZE).sequences
    assert torch.equal(first.slice(0, N).input_ids, second.slice(0, N).input_ids)
    assert isinstance(second.arrays["input_ids"], __import__("numpy").memmap)
    with pytest.raises(AssertionError, match="cache hit"):  # another seq_len is another key: it tokenizes again
        build_stream(DataConfig(**{**cfg.__dict__, "seq_len": 80}), seed=0, vocab_size=TINY_VOCAB_SIZE)
    edited = tmp_path / "d.parquet"
    datasets.Dataset.from_dict({k: v[:5] for k, v in ROWS["prompt_completion"].items()}).to_parquet(str(edited))
    with pytest.raises(AssertionError, match="cache hit"):  # rewritten data files are a miss too
        build_stream(cfg, seed=0, vocab_size=TINY_VOCAB_SIZE)


def _bad_template(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(TOKENIZER_DIR, folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role here') }}"
        "{% endif %}{% endfor %}" + template
    )
    return str(folder)


def test_bad_data_names_file_and_row(tmp_path):
    files = _save(tmp_path, {"question": ["a"], "answer": ["b"]}, "parquet")
    with pytest.raises(
        DataError,
        match=r"d.parquet: data.format='prompt_completion' needs column\(s\) "
        r"\['prompt', 'completion'\], but the dataset has \['question', 'answer'\]",
    ):
        build_stream(_cfg(tmp_path, format="prompt_completion", **files), seed=0, vocab_size=TINY_VOCAB_SIZE)
    with pytest.raises(DataError, match=r"no row format fits the columns \['question', 'answer'\]"):
        build_stream(_cfg(tmp_path, **files), seed=0, vocab_size=TINY_VOCAB_SIZE)
    mapped = _cfg(tmp_path, columns={"prompt": "question", "completion": "answer"}, **files)
    assert len(build_stream(mapped, seed=0, vocab_size=TINY_VOCAB_SIZE).sequences) == 1

    empty = _save(tmp_path, {"text": []}, "parquet", name="empty")
    with pytest.raises(DataError, match=r"empty.parquet: the file has no rows"):
        build_stream(_cfg(tmp_path, format="text", **empty), seed=0, vocab_size=TINY_VOCAB_SIZE)
    split = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a b"]}),
            "test": datasets.Dataset.from_dict({"text": ["x"]}).select([]),
        }
    )
    split.save_to_disk(str(tmp_path / "dict"), num_shards={"train": 1, "test": 1})
    with pytest.raises(DataError, match=r"dict: the split 'test' has no rows"):
        build_stream(_cfg(tmp_path, path=str(tmp_path / "dict"), split="test"), seed=0, vocab_size=TINY_VOCAB_SIZE)
    with pytest.raises(DataError, match=r"has no split 'dev'; its splits: \['train', 'test'\]"):
        build_stream(_cfg(tmp_path, path=str(tmp_path / "dict"), split="dev"), seed=0, vocab_size=TINY_VOCAB_SIZE)

    blank = _save(tmp_path, {"text": ["", ""]}, "parquet", name="blank")  # an eos alone: nothing to predict
    with pytest.raises(DataError, match=r"blank.parquet: every label is masked"):
        build_stream(_cfg(tmp_path, **blank), seed=0, vocab_size=TINY_VOCAB_SIZE)

    rows = {
        "messages": [
            ROWS["messages"]["messages"][0],
            [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}],
        ]
    }
    tool = _save(tmp_path, rows, "json", name="tool")
    with pytest.raises(DataError, match=r"tool.json: row 1: the chat template failed on this row .*no tool role here"):
        build_stream(_cfg(tmp_path, tokenizer=_bad_template(tmp_path), **tool), seed=0, vocab_size=TINY_VOCAB_SIZE)

    rows = {"messages": [ROWS["messages"]["messages"][0], [{"role": "user", "content": "no answer"}]]}
    with pytest.raises(DataError, match=r"noanswer.parquet: row 1: no assistant message"):
        build_stream(
            _cfg(tmp_path, **_save(tmp_path, rows, "parquet", name="noanswer")), seed=0, vocab_size=TINY_VOCAB_SIZE
        )
    with pytest.raises(DataError, match=r"data.data_files: file .*missing.parquet does not exist"):
        build_stream(_cfg(tmp_path, data_files=str(tmp_path / "missing.parquet")), seed=0, vocab_size=TINY_VOCAB_SIZE)


def test_bad_data_fails_before_the_run_directory(tmp_path):
    from workbench.train import finetune

    files = _save(tmp_path, {"question": ["a"]}, "parquet")
    rc = RunConfig.demo(output_dir=str(tmp_path / "runs"), data=_cfg(tmp_path, **files), train__steps=1)
    with pytest.raises(DataError, match=r"d.parquet: no row format fits the columns \['question'\]"):
        finetune(rc)
    assert not (tmp_path / "runs").exists()


def test_config_validation_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match=r"exactly one of data\.data_files"):
        DataConfig(kind="datasets")
    with pytest.raises(ConfigError, match="not one of the file types"):
        DataConfig(kind="datasets", data_files="d.txt")
    with pytest.raises(ConfigError, match=r"data.columns has unknown row field\(s\) \['question'\]"):
        DataConfig(kind="datasets", data_files="d.csv", columns={"question": "q"})
    with pytest.raises(ConfigError, match=r"data\.eval_every needs eval rows"):
        DataConfig(kind="datasets", data_files="d.csv", eval_every=2)
    with pytest.raises(ConfigError, match=r"data.eval_fraction only apply to data.kind='datasets'"):
        DataConfig(kind="jsonl", eval_fraction=0.1)
    with pytest.raises(ConfigError, match=r"data\.format 'chat' is not one of"):
        DataConfig(kind="datasets", data_files="d.csv", format="chat")
    rc = RunConfig.demo().with_overrides(
        {
            "data.kind": "datasets",
            "data.data_files": ["a.parquet", "b.parquet"],
            "data.columns": {"prompt": "q"},
            "data.eval_fraction": 0.1,
            "data.eval_every": 5,
        }
    )
    assert rc.data.data_files == ["a.parquet", "b.parquet"] and rc.data.columns == {"prompt": "q"}
    assert RunConfig.from_yaml(rc.to_yaml()).data == rc.data
    import argparse

    from workbench.cli_common import config_overrides

    sets = [
        "data.kind=datasets",
        "data.data_files=[a.parquet]",
        "data.columns={prompt: q, completion: a}",
        "data.eval_fraction=0.1",
        "data.eval_every=5",
        "data.assistant_only_loss=false",
    ]
    cli = RunConfig.demo().with_overrides(config_overrides(argparse.Namespace(set=sets)))
    assert cli.data.columns == {"prompt": "q", "completion": "a"} and cli.data.data_files == ["a.parquet"]
    assert cli.data.assistant_only_loss is False and cli.data.eval_every == 5


def test_model_folder_tokenizer_is_used(tmp_path):
    from workbench.train.data_tokenizer import resolve_tokenizer_dir

    folder = tmp_path / "model"
    shutil.copytree(TOKENIZER_DIR, folder)
    cfg = DataConfig(kind="jsonl")
    assert resolve_tokenizer_dir(cfg, str(folder)) == folder
    assert resolve_tokenizer_dir(cfg, str(tmp_path)) == TOKENIZER_DIR  # no tokenizer files there: the shipped one
    assert resolve_tokenizer_dir(cfg, None) == TOKENIZER_DIR
    own = DataConfig(kind="jsonl", tokenizer=str(TOKENIZER_DIR))
    assert resolve_tokenizer_dir(own, str(folder)) == TOKENIZER_DIR


def test_studio_run_panel_builds_a_datasets_config(tmp_path):
    pytest.importorskip("ipywidgets")
    from workbench.ui.run_panel import RunPanel

    panel = RunPanel(None)
    panel.data_kind.value = "datasets"
    panel.data_path.value = str(tmp_path / "rows.parquet")
    assert panel.run_config().data.data_files == str(tmp_path / "rows.parquet")
    panel.data_path.value = str(tmp_path / "saved")
    assert panel.run_config().data.path == str(tmp_path / "saved") and panel.run_config().data.data_files is None


def test_without_datasets_the_error_says_how_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` sees where it is not installed
    (tmp_path / "x.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="pip install datasets"):
        build_stream(_cfg(tmp_path, data_files=str(tmp_path / "x.parquet")), seed=0, vocab_size=TINY_VOCAB_SIZE)
    synthetic = build_stream(DataConfig(kind="synthetic"), seed=0, vocab_size=TINY_VOCAB_SIZE)
    assert synthetic.next_batch(2).input_ids.shape == (2, 128)  # synthetic data needs no datasets


def test_two_builds_of_one_key_keep_the_first(tmp_path):
    cfg = _cfg(tmp_path, **_save(tmp_path, ROWS["text"], "parquet"))
    folder = tmp_path / "cache" / data_cache.cache_key(cfg, TOKENIZER_DIR)
    folder.parent.mkdir(parents=True)
    dead = folder.parent / f".tmp-{folder.name}-{2**22 + 12345}"  # over Linux's pid_max: no such process
    (dead / "work").mkdir(parents=True)
    data_cache.build_cache(cfg, TOKENIZER_DIR, TINY_VOCAB_SIZE, folder)
    assert not dead.exists()  # a killed build's leftovers are removed
    data_cache.build_cache(cfg, TOKENIZER_DIR, TINY_VOCAB_SIZE, folder)  # a run that raced the first one
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # its leftovers are gone
    assert len(data_cache.MappedSequences(folder / "train")) == N


def test_long_text_documents_are_cut_without_a_length_warning(tmp_path, capfd, caplog):
    long = " ".join(f"w{i}" for i in range(1500))  # over the tokenizer's model_max_length
    cfg = _cfg(tmp_path, seq_len=64, **_save(tmp_path, {"text": [long]}, "parquet"))
    seqs = build_stream(cfg, seed=0, vocab_size=TINY_VOCAB_SIZE).sequences
    b = seqs.slice(0, len(seqs))
    assert len(seqs) > 1 and (b.position_ids[:, 0] == 0).all()  # pieces of seq_len, each restarting positions
    logged = capfd.readouterr().err + caplog.text
    assert "longer than the specified maximum" not in logged
