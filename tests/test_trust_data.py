"""Data the trainer must not trust blindly: the tokenized cache, the files a config names, rows, and the messages.

Each refusal is a DataError (a ConfigError: one line and exit code 2 on the CLI) raised before the run
folder exists.
"""

import builtins
import errno
import json
import os
import shutil

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

from workbench.config import TINY_VOCAB_SIZE, TOKENIZER_DIR, ConfigError, DataConfig, RunConfig  # noqa: E402
from workbench.errors import DataError  # noqa: E402
from workbench.train import data_cache, data_rows  # noqa: E402
from workbench.train.data import build_stream  # noqa: E402

N = 12
ROWS = {
    "prompt": [f"what is {i} plus 1?" for i in range(N)],
    "completion": [f"{i} plus 1 is {i + 1}." for i in range(N)],
}


def _parquet(tmp_path, rows=ROWS, name="d"):
    path = tmp_path / f"{name}.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    return path


def _cfg(tmp_path, **kw):
    return DataConfig(**{"kind": "datasets", "seq_len": 96, "pack": False, "cache_dir": str(tmp_path / "cache"), **kw})


def _stream(cfg):
    return build_stream(cfg, seed=0, vocab_size=TINY_VOCAB_SIZE)


def _all(seqs):
    return seqs.slice(0, len(seqs))


def _finetune_refused(tmp_path, match, **data):
    from workbench.train import finetune

    runs = tmp_path / "runs"
    rc = RunConfig.demo(output_dir=str(runs), data__seq_len=64, train__steps=1, **data)
    with pytest.raises(DataError, match=match):
        finetune(rc)
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


# -- the tokenized cache: digests, sizes, token ids ------------------------------------------------


def _overwrite(path, data: np.ndarray):
    path.write_bytes(data.astype(np.int32).tobytes())


TAMPERING = {
    "input_ids overwritten": lambda f: _overwrite(
        f / "input_ids.bin", np.random.default_rng(0).integers(3, 500, (f / "input_ids.bin").stat().st_size // 4)
    ),
    "every label masked": lambda f: _overwrite(f / "labels.bin", np.full((f / "labels.bin").stat().st_size // 4, -100)),
    "truncated": lambda f: (f / "position_ids.bin").write_bytes((f / "position_ids.bin").read_bytes()[:-400]),
    "meta.json disagrees": lambda f: (f / "meta.json").write_text(
        json.dumps({**json.loads((f / "meta.json").read_text()), "num_sequences": N + 1})
    ),
}


@pytest.mark.parametrize("how", list(TAMPERING))
def test_a_damaged_cache_is_rebuilt_from_its_sources(tmp_path, capsys, how):
    cfg = _cfg(tmp_path, data_files=str(_parquet(tmp_path)))
    first = _all(_stream(cfg).sequences)
    (folder,) = (tmp_path / "cache").iterdir()
    TAMPERING[how](folder / "train")
    capsys.readouterr()
    again = _all(_stream(cfg).sequences)
    out = capsys.readouterr().out
    assert f"data: tokenized cache {folder} is damaged (train/" in out and "rebuilding it from its sources" in out
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(again, name), getattr(first, name)), name
    _stream(cfg)  # the rebuilt cache is a clean hit
    assert capsys.readouterr().out == f"data: tokenized cache {folder}\n"


def test_a_damaged_cache_whose_sources_cannot_be_read_is_refused(tmp_path):
    data = _parquet(tmp_path)
    cfg = _cfg(tmp_path, data_files=str(data))
    _stream(cfg)
    (folder,) = (tmp_path / "cache").iterdir()
    TAMPERING["every label masked"](folder / "train")
    stat = data.stat()  # the same size and mtime: the same cache key, but no longer a parquet file
    data.write_bytes(b"\0" * stat.st_size)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(DataError, match=r"tokenized cache .* is damaged \(train/labels.bin does not match its digest"):
        _stream(cfg)


def test_mapping_a_cache_checks_sizes_against_meta_first(tmp_path):
    cfg = _cfg(tmp_path, data_files=str(_parquet(tmp_path)))
    _stream(cfg)
    (folder,) = (tmp_path / "cache").iterdir()
    TAMPERING["truncated"](folder / "train")
    with pytest.raises(DataError, match=r"position_ids.bin is \d+ bytes, meta.json says \d+; delete .* rebuilt"):
        data_cache.MappedSequences(folder / "train")


@pytest.fixture
def gapped_tokenizer(tmp_path):
    """A tokenizer of 512 tokens (the model's vocab_size) whose token ' green' has the id 900."""
    folder = tmp_path / "tok"
    shutil.copytree(TOKENIZER_DIR, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["vocab"]["\u0120green"] = 900
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return str(folder)


@pytest.mark.parametrize("kind", ["jsonl", "datasets"])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_run_folder(tmp_path, gapped_tokenizer, kind):
    rows = [{"prompt": "what colour is grass?", "response": "grass is green"}] * 4
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    where = {"data__path": str(data)}
    if kind == "datasets":
        where = {"data__kind": "datasets", "data__data_files": str(data), "data__cache_dir": str(tmp_path / "c")}
    _finetune_refused(
        tmp_path,
        r"token id 900 is outside the model's vocabulary \(vocab_size 512: ids 0 to 511\); the tokenizer does "
        r"not match the model",
        data__tokenizer=gapped_tokenizer,
        **where,
    )


# -- which files ------------------------------------------------------------------------------


def test_a_data_file_named_twice_is_refused(tmp_path):
    data = _parquet(tmp_path)
    (tmp_path / "sub").mkdir()
    other_spelling = str(tmp_path / "sub" / ".." / "d.parquet")
    with pytest.raises(DataError, match=rf"data.data_files names the file {data} twice \(as {data} and .*sub/\.\./d"):
        _stream(_cfg(tmp_path, data_files=[str(data), other_spelling]))
    with pytest.raises(DataError, match=r"names the file .*d.parquet twice: its rows would be trained on twice"):
        _stream(_cfg(tmp_path, data_files=[str(data), str(data)]))


def test_eval_files_that_are_training_files_are_refused(tmp_path):
    data, held = _parquet(tmp_path), _parquet(tmp_path, name="held")
    with pytest.raises(DataError, match=rf"data.eval_files and data.data_files both name {data}: .*data.eval_fraction"):
        _stream(_cfg(tmp_path, data_files=[str(data)], eval_files=[str(held), str(data)], eval_every=1))
    assert _stream(_cfg(tmp_path, data_files=str(data), eval_files=str(held), eval_every=1)).eval_sequences


def test_globs_are_expanded_sorted_and_one_that_matches_nothing_is_refused(tmp_path):
    half = N // 2
    _parquet(tmp_path, {k: v[half:] for k, v in ROWS.items()}, name="part-1")
    _parquet(tmp_path, {k: v[:half] for k, v in ROWS.items()}, name="part-0")
    both = _all(_stream(_cfg(tmp_path, data_files=str(tmp_path / "part-*.parquet"))).sequences)
    whole = _all(_stream(_cfg(tmp_path, data_files=str(_parquet(tmp_path)))).sequences)
    assert torch.equal(both.input_ids, whole.input_ids)  # part-0 before part-1: the rows in their order
    with pytest.raises(DataError, match=r"data.data_files: the pattern '.*nope-\*.parquet' matches nothing"):
        _stream(_cfg(tmp_path, data_files=str(tmp_path / "nope-*.parquet")))


def test_eval_files_naming_a_folder_say_so(tmp_path):
    folder = tmp_path / "held.parquet"  # Spark writes a "parquet file" as a folder of parts
    folder.mkdir()
    _parquet(folder, name="part-0")
    with pytest.raises(DataError, match=rf"data.eval_files: {folder} is a folder, not a file; name its files, e.g. "):
        _stream(_cfg(tmp_path, data_files=str(_parquet(tmp_path)), eval_files=str(folder), eval_every=1))


# -- rows: size before parsing and tokenizing, encoding, emptiness, tool calls ----------------------------


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_huge_chat_row_is_refused_before_it_is_tokenized(tmp_path, monkeypatch, kind):
    rows = {"prompt": ["short", "cat " * (1 << 20)], "completion": ["a", "b"]}  # row 1: 4 MiB of prompt
    ds = datasets.Dataset.from_dict(rows)
    path = tmp_path / f"d.{kind}"
    (ds.to_json if kind == "jsonl" else ds.to_parquet)(str(path))
    rendered = []  # the characters of each conversation that reached the chat template and the tokenizer
    real = data_rows.tokenize_messages

    def recording(tokenizer, messages, where):
        rendered.append(sum(len(m["content"]) for m in messages))
        return real(tokenizer, messages, where)

    monkeypatch.setattr(data_rows, "tokenize_messages", recording)
    with pytest.raises(DataError) as info:
        _stream(_cfg(tmp_path, data_files=str(path)))
    assert str(info.value).startswith(
        f"{path}: row 1: row holds {(4 << 20) + 1} characters of text, more than a row of data.max_length=96 tokens "
        "can take (64 per token, at least 1 MiB)"
    )
    assert rendered == [6]  # row 0 only


def test_a_line_over_the_document_bound_is_refused_before_parsing(tmp_path, monkeypatch):
    from workbench.train import data_files  # the module of file checks (absent before the bound existed)

    monkeypatch.setattr(data_files, "MAX_DOCUMENT_BYTES", 1 << 20)  # the bound (16 MiB) made small for the test
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "a b"}) + "\n" + json.dumps({"text": "word " * (400 << 10)}) + "\n")

    def no_parse(*a, **k):
        raise AssertionError("the file was parsed")

    monkeypatch.setattr(datasets, "load_dataset", no_parse)
    with pytest.raises(DataError, match=rf"^{path}:2: row is over {1 << 20} bytes, more than any row can take"):
        _stream(_cfg(tmp_path, data_files=str(path)))


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_an_empty_data_file_says_so(tmp_path, suffix):
    path = tmp_path / f"empty.{suffix}"
    path.write_bytes(b"" if suffix == "parquet" else b"\n \n")
    with pytest.raises(DataError, match=rf"^{path}: the file is empty \((0 bytes|no rows)\); write rows into it"):
        _stream(_cfg(tmp_path, data_files=str(path)))


def test_non_utf8_bytes_name_the_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"}) + "\n"
    path.write_bytes(good.encode() + '{"prompt": "caf\u00e9", "completion": "b"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8 \(byte 0xe9 .*must be UTF-8 JSON lines.*iconv"):
        _stream(_cfg(tmp_path, data_files=str(path)))


TOOL_ROW = {
    "messages": [
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "add"}}]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
}


@pytest.mark.parametrize("kind", ["jsonl", "datasets"])
def test_tool_call_messages_are_refused_as_unsupported(tmp_path, kind):
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(TOOL_ROW) + "\n")
    if kind == "jsonl":
        match = rf"^{path}:1: messages\[1\] has 'tool_calls': tool calls are not supported"
        with pytest.raises(DataError, match=match):
            build_stream(DataConfig(path=str(path)), seed=0, vocab_size=TINY_VOCAB_SIZE)
    else:
        with pytest.raises(DataError, match=rf"^{path}: row 0: message 1 has 'tool_calls': tool calls are not"):
            _stream(_cfg(tmp_path, data_files=str(path)))


# -- the tokenizer folder and the cache folder ------------------------------------------------


def test_a_missing_tokenizer_folder_is_named(tmp_path):
    missing = tmp_path / "no-tokenizer"
    with pytest.raises(DataError, match=rf"^tokenizer directory {missing} does not exist; set data.tokenizer"):
        _stream(_cfg(tmp_path, data_files=str(_parquet(tmp_path)), tokenizer=str(missing)))


@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja", "tokenizer_config.json"])
def test_a_tokenizer_file_linking_out_of_its_folder_is_refused_before_it_is_read(tmp_path, name):
    folder = tmp_path / "tok"
    shutil.copytree(TOKENIZER_DIR, folder)
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    shutil.move(folder / name, outside)
    (folder / name).symlink_to(outside)
    with pytest.raises(DataError, match=rf"^{folder / name} leads to {outside} \(through a link\), outside {folder}"):
        _stream(_cfg(tmp_path, data_files=str(_parquet(tmp_path)), tokenizer=str(folder)))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_model_folders_own_tokenizer_linking_out_is_refused_for_finetune(tmp_path):
    """The model folder's tokenizer (used when data.tokenizer is unset) is held to the same rule."""
    from workbench.train.data_tokenizer import check_tokenizer_dir, resolve_tokenizer_dir

    model = tmp_path / "model"
    model.mkdir()
    outside = tmp_path / "elsewhere.json"
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", outside)
    (model / "tokenizer.json").symlink_to(outside)
    chosen = resolve_tokenizer_dir(_cfg(tmp_path, data_files=str(_parquet(tmp_path))), str(model))
    assert chosen == model
    with pytest.raises(DataError, match="through a link"):
        check_tokenizer_dir(chosen)
    # the same folder with the file copied in is taken
    (model / "tokenizer.json").unlink()
    shutil.copy(outside, model / "tokenizer.json")
    assert check_tokenizer_dir(model) == model


def test_a_cache_dir_that_is_a_file_names_data_cache_dir(tmp_path):
    blocker = tmp_path / "cachefile"
    blocker.write_text("not a folder")
    with pytest.raises(DataError, match=rf"^data.cache_dir {blocker}: cannot write the tokenized cache \(EEXIST"):
        _stream(_cfg(tmp_path, data_files=str(_parquet(tmp_path)), cache_dir=str(blocker)))


def test_a_full_disk_while_packing_names_data_cache_dir(tmp_path, monkeypatch):
    real_open = builtins.open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            self.f.close()

    def opening(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return FullDisk(f) if str(file).endswith(".bin") and "w" in mode else f

    monkeypatch.setattr(builtins, "open", opening)
    cache = tmp_path / "cache"
    with pytest.raises(
        DataError, match=rf"^data.cache_dir {cache}: cannot write the tokenized cache \(ENOSPC: No space"
    ):
        _stream(_cfg(tmp_path, data_files=str(_parquet(tmp_path))))
    assert [p.name for p in cache.iterdir()] == []  # the half-written build is removed


def test_a_full_disk_while_datasets_reads_the_file_is_not_blamed_on_the_file(tmp_path, monkeypatch):
    from datasets.arrow_writer import ArrowWriter

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for name in ("write_row", "write_table"):  # how datasets writes the rows it reads into its arrow files
        monkeypatch.setattr(ArrowWriter, name, full)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    with pytest.raises(DataError) as info:
        _stream(_cfg(tmp_path, data_files=str(path)))
    msg = str(info.value)
    assert msg.startswith(f"data.cache_dir {tmp_path / 'cache'}: cannot write the tokenized cache (ENOSPC")
    assert "free space there" in msg and "could not be read" not in msg


# -- the CLI: one line, exit code 2, no run folder ---------------------------------------------


def test_a_data_error_is_one_line_and_exit_code_2_on_the_cli(tmp_path, capsys):
    from workbench.cli import main

    data = _parquet(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    RunConfig.demo(data=_cfg(tmp_path, data_files=[str(data), str(data)]), train__steps=1).to_yaml(cfg)
    capsys.readouterr()
    code = main(["finetune", str(cfg), "--output-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == [
        f"workbench finetune: data.data_files names the file {data} twice: its rows would be trained on twice; "
        "list each file once"
    ], err
    assert not (tmp_path / "runs").exists()
    assert issubclass(DataError, ConfigError)
