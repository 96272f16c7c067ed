"""Publishing step records once: the engine's StreamCallback, the notebook's RecordStore, the gap reader."""

from __future__ import annotations

import json

import pytest

from workbench.cluster.engine import StreamCallback, carries_expert_load
from workbench.cluster.records import RecordStore, records_from_end
from workbench.ui.series import live_series


def _record(rank: int, step: int, layers: int = 2, experts: int = 4) -> dict:
    load = [[(step * 7 + rank * 3 + layer * 5 + e) % 11 + 1 for e in range(experts)] for layer in range(layers)]
    return {
        "rank": rank,
        "step": step,
        "loss": 1.0 / step,
        "tokens_per_s_per_gpu": 100.0 + step,
        "tflops_per_gpu": 0.5,
        "mem_peak_gib": 1.0 + rank,
        "expert_load": load,
    }


def test_each_record_is_published_once_in_order_with_bounded_matrices():
    sent: list[dict] = []
    stream = StreamCallback(min_interval_s=0.0, load_every=10, publish=sent.append)
    stream.on_start({"total_steps": 25})
    for step in range(1, 26):
        stream.on_step(_record(0, step))
    stream.on_end({"state": "completed"})

    ranges = [(m["first_seq"], m["last_seq"]) for m in sent]
    assert ranges == [(s, s) for s in range(1, 26)]  # one message per record, none resent at the end
    steps = [r["step"] for m in sent for r in m["records"]]
    assert steps == list(range(1, 26))
    with_load = [r["step"] for m in sent for r in m["records"] if "expert_load" in r]
    assert with_load == [1, 11, 21, 25]  # every 10th step and the last
    assert all(carries_expert_load(s, 25, 10) == (s in with_load) for s in steps)


def test_records_arriving_at_once_share_a_message_and_the_end_sends_only_the_rest():
    sent: list[dict] = []
    stream = StreamCallback(min_interval_s=3600.0, load_every=1, publish=sent.append)
    stream.on_start({"total_steps": 6})
    for step in (1, 2, 3):  # the trainer collects three finished steps in a row
        stream.on_step(_record(1, step))
    assert [(m["first_seq"], m["last_seq"]) for m in sent] == [(1, 1)]  # the rest wait for the interval
    for step in (4, 5, 6):
        stream.on_step(_record(1, step))
    stream.on_end({})
    stream.on_end({})  # the trainer and the engine wrapper both end the stream
    assert [(m["first_seq"], m["last_seq"]) for m in sent] == [(1, 1), (2, 6)]
    assert [r["step"] for r in sent[1]["records"]] == [2, 3, 4, 5, 6]
    assert stream.pending == [] and stream.published == stream.seq == 6


def test_no_channel_keeps_nothing_on_the_engine():
    def broken(message):
        raise RuntimeError("not inside an engine")

    stream = StreamCallback(min_interval_s=0.0, publish=broken)
    for step in range(1, 100):
        stream.on_step(_record(0, step))
    assert stream.pending == [] and stream.published == 99
    with pytest.raises(ValueError, match="load_every"):
        StreamCallback(load_every=0)


def test_store_holds_each_record_once_and_only_the_latest_complete_matrices():
    records = [_record(rank, step) for step in range(1, 101) for rank in (0, 1)]
    store = RecordStore(world_size=2)
    assert len(store.add(records[:150], "stream")) == 150
    assert store.add(records[100:150], "disk") == []  # already held: not again
    store.add(records[150:], "disk")
    assert store.sources == {"stream": 150, "disk": 50}
    assert store.count(0) == store.count(1) == 100
    assert store.held_loads() == 2  # one step x two ranks, not 200 matrices
    held = store.records()
    assert [(r["rank"], r["step"]) for r in held] == [(r["rank"], r["step"]) for r in records]
    assert [r["step"] for r in held if "expert_load" in r] == [100, 100]
    # The plots draw the same from the store as from every record.
    assert live_series(held) == live_series(records)


def test_store_keeps_newer_matrices_until_every_rank_has_one():
    store = RecordStore(world_size=2)
    store.add([_record(0, 1), _record(1, 1), _record(0, 2), _record(0, 3)], "stream")
    assert live_series(store.records())["expert_load"]["step"] == 1
    store.add([_record(1, 2)], "stream")
    series = live_series(store.records())
    assert series["expert_load"]["step"] == 2
    assert store.held_loads() == 3  # step 2 of both ranks, step 3 of rank 0 waits for rank 1


def _write(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_records_from_end_reads_backward_across_chunks(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [_record(step % 2, step) for step in range(1, 41)]
    _write(path, records, tail='{"rank": 0, "step": 99, "lo')  # a line still being written
    for chunk in (7, 64, 1000, 2**20):
        assert list(records_from_end(path, chunk_bytes=chunk)) == records[::-1], chunk
    # Stopping early reads only the end of the file.
    reader = records_from_end(path, chunk_bytes=256)
    assert [next(reader)["step"] for _ in range(3)] == [40, 39, 38]
    assert list(records_from_end(tmp_path / "missing.jsonl")) == []
    path.write_text('{"rank": 0, "st')
    assert list(records_from_end(path, chunk_bytes=4)) == []
    path.write_text('{"rank": 0, "step": 1}\ngarbled\n{"rank": 0, "step": 2}\n')
    assert [r["step"] for r in records_from_end(path, chunk_bytes=5)] == [2, 1]


def test_gap_filler_adds_only_missing_records_and_waits_for_the_file_to_grow(tmp_path):
    from workbench.cluster.records import GapFiller

    path = tmp_path / "metrics.jsonl"
    records = [_record(rank, step) for step in range(1, 6) for rank in (0, 1)]
    lines = [json.dumps(r).ljust(300) + "\n" for r in records]
    path.write_text("".join(lines[:8]))  # steps 1-4 of both ranks on disk so far
    store = RecordStore(world_size=2)
    store.add([records[0], records[1], records[6]], "stream")  # rank 0 and 1 step 1; rank 0 step 4
    gaps = GapFiller(store, path)
    new = gaps.fill({0: 5, 1: 1})  # rank 0 published 5 records, rank 1 one
    assert [(r["rank"], r["step"]) for r in new] == [(0, 2), (0, 3)]
    assert gaps.fill({0: 5, 1: 1}) == []  # step 5 is not written yet
    path.write_text("".join(lines[:7] + [lines[8]]))  # same size: not scanned again (a file that grows is)
    assert gaps.fill({0: 5, 1: 1}) == []
    _write(path, records)
    assert [(r["rank"], r["step"]) for r in gaps.fill({0: 5, 1: 1})] == [(0, 5)]
    assert store.count(0) == 5 and store.count(1) == 1 and store.sources == {"stream": 3, "disk": 3}
    assert gaps.fill({0: 5, 1: 1}) == [] and GapFiller(store, tmp_path / "none").fill({1: 9}) == []
