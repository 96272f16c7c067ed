"""`workbench generate` and workbench.generate: a tiny trained run (full and LoRA) answers from its export and from its
latest checkpoint with the weights Transformers' own generate() uses; bad runs and settings are one line, exit 2."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_runs import train_tiny_run

import workbench
from workbench.cli import main
from workbench.config import RunConfig
from workbench.generation.api import load
from workbench.runs.run_dir import RunDir
from workbench.train.loop import finetune
from workbench.train.manifest import write_manifest

PROMPT = "What does a router do?"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"full": run folder, "lora": run folder}: 3 steps each, with an hf/ export and a step-3 checkpoint."""
    root = tmp_path_factory.mktemp("generate") / "runs"
    return {"full": train_tiny_run(root, "full"), "lora": train_tiny_run(root, "lora", lora=True)}


def _reference(export: Path, prompt_ids: list[int], **kwargs) -> torch.Tensor:
    """The new token ids of Transformers' own generate() on the export's weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, **kwargs)
    return out[0, ids.shape[1] :]


def _prompt_ids(tokenizer, chat: bool) -> list[int]:
    if not chat:
        return tokenizer(PROMPT)["input_ids"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("kind", "chat"), [("full", True), ("lora", True), ("full", False)])
def test_greedy_reply_equals_transformers_generate_from_export_and_from_checkpoint(runs, kind, chat, capsys, tmp_path):
    run = runs[kind]
    loaded = load(run, device="cpu")
    assert loaded.weights.source == "export"
    ids = _prompt_ids(loaded.tokenizer, chat)
    eos = loaded.tokenizer.eos_token_id
    expected_ids = _reference(run / "hf", ids, do_sample=False, pad_token_id=0, eos_token_id=eos)
    expected = loaded.tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert expected.strip()
    flags = ["--temperature", 0, "--max-new-tokens", NEW_TOKENS, "--device", "cpu"] + (
        [] if chat else ["--no-chat-template"]
    )

    code, out, err = _cli(capsys, run, "--prompt", PROMPT, *flags)
    assert code == 0, err
    assert out == expected + "\n"
    assert "its Transformers export" in err

    # Without the export the newest checkpoint answers: the same weights (a LoRA run's: base + adapters, merged)
    moved = tmp_path / "hf"
    shutil.move(run / "hf", moved)
    try:
        from_ckpt = load(run, device="cpu")
        assert from_ckpt.weights.source == "checkpoint" and from_ckpt.step == 3
        exported = transformers.AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float32).eval()
        probe = torch.tensor([ids])
        with torch.inference_mode():
            assert torch.equal(from_ckpt.model(probe).logits, exported(probe).logits)
        code, out, err = _cli(capsys, run.name, "--runs-dir", run.parent, "--prompt", PROMPT, *flags)
        assert code == 0, err
        assert out == expected + "\n"
        assert "its latest checkpoint" in err and "step-00000003" in err
    finally:
        shutil.move(moved, run / "hf")


def test_seeded_sample_is_repeatable_and_streams_in_pieces(runs):
    run = runs["full"]
    loaded = load(run, device="cpu")
    settings = dict(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=NEW_TOKENS)
    pieces = list(workbench.generate_stream(loaded, PROMPT, **settings))
    assert len(pieces) > 1  # token by token, not one block at the end
    text = "".join(pieces)
    assert text == workbench.generate(loaded, PROMPT, **settings)  # the seed decides the sample
    torch.manual_seed(7)
    expected_ids = _reference(
        run / "hf",
        _prompt_ids(loaded.tokenizer, True),
        do_sample=True,
        temperature=1.0,
        top_p=0.9,
        top_k=0,
        pad_token_id=0,
        eos_token_id=loaded.tokenizer.eos_token_id,
    )
    assert text == loaded.tokenizer.decode(expected_ids, skip_special_tokens=True)


def test_bad_run_or_settings_is_one_line_exit_2(runs, capsys, tmp_path):
    runs_dir = runs["full"].parent
    code, out, err = _cli(capsys, "no-such-run", "--runs-dir", runs_dir, "--prompt", "hi")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "no run 'no-such-run'" in err and "workbench runs" in err

    # a run that has not saved anything yet
    RunDir.create(tmp_path, "fresh", RunConfig.demo().to_dict())
    code, out, err = _cli(capsys, tmp_path / "fresh", "--prompt", "hi")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "has no weights yet" in err and "train.checkpoint_every" in err

    code, _, err = _cli(capsys, tmp_path, "--prompt", "hi")  # a folder that is not a run
    assert code == 2 and "is not a run folder" in err

    for flags, said in (
        (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top-p", "1.5"], "top_p must be a finite number in"),
        (["--prompt", " "], "the prompt must be a non-empty string"),
        *([(["--device", "cuda"], "device 'cuda' needs a CUDA GPU")] if not torch.cuda.is_available() else []),
    ):
        code, out, err = _cli(capsys, runs["full"], "--prompt", "hi", *flags)
        assert code == 2 and out == "" and said in err, err


class _RunsCode:
    """Unpickling this runs a shell command (what a crafted checkpoint file would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_checkpoint_is_refused_without_running_it(runs, capsys, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(runs["full"], run)
    shutil.rmtree(run / "hf")  # the checkpoint is what answers
    ckpt = run / "checkpoints" / "step-00000003"
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    write_manifest(ckpt)  # an attacker rewrites the manifest too
    code, out, err = _cli(capsys, run, "--prompt", "hi", "--device", "cpu")
    assert code == 2 and out == ""
    assert "is not DCP metadata, refused without loading it" in err
    assert not marker.exists()


def test_lora_run_on_a_model_path_answers_on_the_base_it_recorded(capsys, tmp_path):
    from workbench.config import ModelConfig, preset_config

    base = tmp_path / "base"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(preset_config("tiny")).save_pretrained(base)
    rc = RunConfig.demo(
        model=ModelConfig(preset=None, path=str(base)),
        output_dir=str(tmp_path / "runs"),
        run_id="on-base",
        data__seq_len=64,
        train__steps=2,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
        train__lr=1e-2,
    ).with_overrides({"lora.rank": 4})
    run = Path(finetune(rc)["run_dir"])  # a step-2 checkpoint of the adapters only, no export
    flags = ["--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", NEW_TOKENS, "--device", "cpu"]
    code, out, err = _cli(capsys, run, *flags)
    assert code == 0 and out.strip(), err

    # The base the adapters were trained on is recorded: other weights in that folder are refused, not used
    weights = base / "model.safetensors"
    kept = tmp_path / "kept.safetensors"
    shutil.copy(weights, kept)
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    code, out, err = _cli(capsys, run, *flags)
    assert code == 2 and out == "" and "the weight files in" in err and "changed since" in err
    shutil.copy(kept, weights)

    shutil.move(base, tmp_path / "moved")  # the folder is gone: said, with the fix
    code, out, err = _cli(capsys, run, *flags)
    assert code == 2 and f"model.path {base}, which is gone" in err and "put it back there" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the reply on one GPU, in bfloat16")
def test_reply_on_the_gpu_equals_transformers_generate_there(runs, capsys, tmp_path):
    run = runs["full"]
    loaded = load(run, device="cuda")
    assert loaded.device.type == "cuda" and loaded.model.dtype == torch.bfloat16  # model.dtype "auto" on CUDA
    ids = torch.tensor([_prompt_ids(loaded.tokenizer, True)], device="cuda")
    export = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.bfloat16).to("cuda").eval()
    with torch.inference_mode():
        out = export.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=loaded.tokenizer.eos_token_id,
        )
    expected = loaded.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    flags = ["--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", NEW_TOKENS, "--device", "cuda"]
    assert _cli(capsys, run, *flags)[:2] == (0, expected + "\n")
    moved = tmp_path / "hf"
    shutil.move(run / "hf", moved)  # the checkpoint, built on the GPU, answers the same
    try:
        assert _cli(capsys, run, *flags)[:2] == (0, expected + "\n")
    finally:
        shutil.move(moved, run / "hf")
