"""Eval on held-out rows (data.kind='datasets'): the loss it reports, the records it lands in, resume, 2 ranks."""

import json

import pytest
import torch
from launch_utils import run_ranks

datasets = pytest.importorskip("datasets")

from workbench.config import TINY_VOCAB_SIZE, DataConfig, RunConfig  # noqa: E402
from workbench.train import finetune  # noqa: E402
from workbench.train.data import build_stream  # noqa: E402
from workbench.train.data_batch import IGNORE_INDEX  # noqa: E402

ROWS = {
    "prompt": [f"what is {i} plus {i % 5}?" for i in range(40)],
    "completion": [f"{i} plus {i % 5} is {i + i % 5}." for i in range(40)],
}


def _data(tmp_path, **kw):
    path = tmp_path / "rows.parquet"
    if not path.exists():
        datasets.Dataset.from_dict(ROWS).to_parquet(str(path))
    base = dict(
        kind="datasets",
        data_files=str(path),
        seq_len=64,
        eval_fraction=0.2,
        eval_every=2,
        cache_dir=str(tmp_path / "cache"),
    )
    base.update(kw)
    return DataConfig(**base)


def _rc(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "runs"),
        data=_data(tmp_path),
        train__steps=5,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
    )
    base.update(overrides)
    return RunConfig.demo(**base)


def _records(tmp_path, run_id):
    lines = (tmp_path / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_eval_loss_equals_the_models_loss_on_the_eval_rows(tmp_path):
    from workbench.train.data_eval import evaluate
    from workbench.train.loop import Trainer

    trainer = Trainer(_rc(tmp_path))
    trainer.setup()
    held = trainer.stream.eval_sequences
    assert len(held) >= 3  # more than one local batch: the sums run over several forwards
    got = evaluate(trainer.model, held, 2, trainer.device)
    b = held.slice(0, len(held))
    with torch.no_grad():
        trainer.model.eval()
        out = trainer.model(
            input_ids=b.input_ids,
            labels=b.labels,
            position_ids=b.position_ids,
            output_router_logits=False,
            use_cache=False,
        )
    # Transformers' own loss: the mean over every non-masked eval token, one forward of the whole set.
    assert got["eval_loss"] == pytest.approx(float(out.loss), rel=1e-5)
    targets = b.labels[:, 1:]
    keep = targets != IGNORE_INDEX
    logits = trainer.model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits[:, :-1]
    assert got["eval_accuracy"] == pytest.approx(float(((logits.argmax(-1) == targets) & keep).sum() / keep.sum()))
    assert got["eval_tokens"] == int(keep.sum())


@pytest.mark.slow
def test_eval_runs_every_n_steps_and_resume_is_exact(tmp_path):
    full = finetune(_rc(tmp_path, run_id="full", train__checkpoint_every=3))
    recs = _records(tmp_path, "full")
    assert [s for s, r in sorted(recs.items()) if "eval_loss" in r] == [2, 4, 5]  # every 2 and the last
    assert all(0 < recs[s]["eval_loss"] < 20 and 0 <= recs[s]["eval_accuracy"] <= 1 for s in (2, 4, 5))
    assert recs[4]["eval_loss"] != recs[2]["eval_loss"]  # the model moved between evals
    ckpt = tmp_path / "runs" / "full" / "checkpoints" / "step-00000003"
    resumed = finetune(_rc(tmp_path, run_id="resumed", train__resume_from=str(ckpt)))
    assert resumed["losses"] == full["losses"][3:]
    again = _records(tmp_path, "resumed")
    assert [again[s]["eval_loss"] for s in (4, 5)] == [recs[s]["eval_loss"] for s in (4, 5)]


def _two_rank_build(rank, world, cfg):
    from workbench.train import data_cache

    if rank == 1:  # only rank 0 tokenizes; rank 1 maps what rank 0 wrote

        def refuse(*a, **k):
            raise AssertionError("rank 1 loaded the tokenizer")

        data_cache.load_tokenizer = refuse
    stream = build_stream(DataConfig(**cfg), seed=0, vocab_size=TINY_VOCAB_SIZE)
    return stream.next_batch(4).input_ids.tolist(), len(stream.eval_sequences)


@pytest.mark.slow
def test_rank_0_tokenizes_and_every_rank_maps_the_same_cache(tmp_path):
    cfg = _data(tmp_path)
    r0, r1 = run_ranks(_two_rank_build, 2, cfg.__dict__)
    assert r0 == r1
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_live_plots_draw_eval_loss_from_the_records(tmp_path):
    pytest.importorskip("plotly")
    from workbench.runs.run_dir import RunDir
    from workbench.ui.plots import LivePlots
    from workbench.ui.series import live_series

    finetune(_rc(tmp_path, run_id="plots", train__steps=4, train__save_final_checkpoint=False))
    records = RunDir.open(tmp_path / "runs" / "plots").read_metrics()
    series = live_series(records)
    assert series["eval_loss"] == ([2, 4], [r["eval_loss"] for r in records if r["step"] in (2, 4)])
    plots = LivePlots()
    plots.update(records)
    (trace,) = [t for t in plots.figure.data if t.name == "eval loss"]
    assert list(trace.x) == [2, 4] and list(trace.y) == series["eval_loss"][1]
    assert plots.save_png(tmp_path / "live.png").stat().st_size > 10_000


def _two_rank_eval(rank, world, rc_dict):
    from workbench.train.data_eval import evaluate
    from workbench.train.loop import Trainer

    trainer = Trainer(RunConfig.from_dict(rc_dict))
    trainer.setup()
    held = trainer.stream.eval_sequences
    got = evaluate(trainer.model, held, 2, trainer.device)
    b = held.slice(0, len(held))
    with torch.no_grad():  # every rank runs the same whole-set forward (a sharded model's collectives need it)
        trainer.model.eval()
        out = trainer.model(
            input_ids=b.input_ids,
            labels=b.labels,
            position_ids=b.position_ids,
            output_router_logits=False,
            use_cache=False,
        )
    return len(held), got["eval_loss"], float(out.loss)


@pytest.mark.slow
def test_two_rank_eval_covers_every_row_once(tmp_path):
    # 5 eval rows (one per sequence) in rounds of 2 ranks x 2: the last round's second rank runs a masked stand-in
    rc = _rc(tmp_path, data=_data(tmp_path, eval_fraction=0.125, pack=False))
    (n, got, direct), again = run_ranks(_two_rank_eval, 2, rc.to_dict())
    assert again == (n, got, direct) and n % 4 != 0
    assert got == pytest.approx(direct, rel=1e-5)
