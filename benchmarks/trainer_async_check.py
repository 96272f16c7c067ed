"""GPU check of the trainer's sync-free step: host syncs per step, skip flag, records.

    PYTHONPATH=$PWD python benchmarks/trainer_async_check.py

Prints, for a tiny engine model on one CUDA device:
- the synchronizing CUDA calls torch reports (set_sync_debug_mode) during 5 non-logging steps, by origin;
- the HostSyncRecorder's list for one step (ops that force a device -> host read, with frames);
- that a set skip flag leaves weights and optimizer state alone, for torch's fused AdamW and the
  compiled Triton AdamW kernel;
- the records collected afterwards (steps, loss, step time).
Expected: only Transformers' masking_utils (find_packed_sequence_indices, once per forward) in the first
two lists, "skip ok" twice, records for steps 2..7 in order. About 30 s.
"""

from __future__ import annotations

import collections
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    from workbench.config import RunConfig
    from workbench.train.host_syncs import HostSyncRecorder
    from workbench.train.loop import Trainer

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    out = tempfile.mkdtemp()
    rc = RunConfig.demo(
        output_dir=out,
        train__steps=100,
        train__log_every=100,
        train__global_batch_size=4,
        train__local_batch_size=2,
        data__seq_len=128,
        train__save_final_checkpoint=False,
    )
    trainer = Trainer(rc)
    trainer.setup()
    print("optimizer:", type(trainer.optimizer).__name__, "device skip flag:", trainer._device_skip)
    trainer.train_step(1)
    trainer.collect(wait=True)

    origins: collections.Counter[str] = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and "warnings" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
        origins[f"{str(message)[:60]} @ {where}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = show
            for step in range(2, 7):
                trainer.train_step(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(f"synchronizing CUDA calls in 5 non-logging steps: {sum(origins.values())}")
    for key, n in origins.most_common():
        print(f"  {n} x {key}")

    with HostSyncRecorder(depth=8) as rec:
        trainer.train_step(7)
    print("HostSyncRecorder, one step:\n" + rec.report())

    records = trainer.collect(wait=True)
    for r in records:
        print(
            f"  step {r['step']}: loss {r['loss']:.4f} grad_norm {r['grad_norm']:.3f} "
            f"step {r['step_time_s'] * 1e3:.1f} ms (fwd {r['forward_s'] * 1e3:.1f} "
            f"bwd {r['backward_s'] * 1e3:.1f} opt {r['optimizer_s'] * 1e3:.1f})"
        )

    from test_trainer_async import check_skip

    from workbench.train.triton_adamw_optimizer import TritonAdamW

    check_skip(lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True), device="cuda")
    print("skip ok: torch fused AdamW (cuda)")
    opts = []
    check_skip(lambda ps: opts.append(TritonAdamW(ps, lr=0.1)) or opts[-1], device="cuda")
    assert opts[0].updates["triton"] + opts[0].updates["triton_multi"] > 0 and opts[0].updates["torch"] == 0, opts[
        0
    ].updates
    print("skip ok: TritonAdamW kernel (cuda)")


if __name__ == "__main__":
    main()
