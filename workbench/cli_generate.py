"""`workbench generate RUN --prompt TEXT`: the run's latest weights answer, streamed to stdout token by token."""

from __future__ import annotations

import argparse
import sys

from workbench.config_checks import ConfigError
from workbench.errors import CheckpointError
from workbench.generation.settings import MAX_NEW_TOKENS, TEMPERATURE, TOP_P

# Nothing heavy at import: the generation modules (torch, Transformers) load when the command runs,
# as every subcommand's do (workbench.cli), so `workbench --help` stays quick.


def generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run folder, or a run id in the runs directory (`workbench runs` lists them)")
    p.add_argument("--prompt", required=True, help="what to ask the model")
    p.add_argument(
        "--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help=f"reply length cap (default {MAX_NEW_TOKENS})"
    )
    p.add_argument(
        "--temperature", type=float, default=TEMPERATURE, help=f"0 = greedy decoding (default {TEMPERATURE})"
    )
    p.add_argument("--top-p", type=float, default=TOP_P, help=f"nucleus sampling mass, in (0, 1] (default {TOP_P})")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling: the same seed, the same reply")
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send the prompt as it is (by default it is wrapped in the tokenizer's chat template, where it has one)",
    )
    p.add_argument(
        "--runs-dir", help="where a run id is looked up (default: $WORKBENCH_RUNS_DIR or ~/moe-workbench/runs)"
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the model runs (default auto: the first GPU if there is one, else the CPU)",
    )


def run_generate(args: argparse.Namespace) -> int:
    import workbench.generation.api as generation  # torch and Transformers: only once the command runs

    weights = None
    try:
        settings = generation.GenerationSettings(
            args.max_new_tokens, args.temperature, args.top_p, args.seed, not args.no_chat_template
        )
        generation.check_prompt(args.prompt)
        weights = generation.latest_weights(generation.find_run_dir(args.run, args.runs_dir))
        print(f"workbench generate: {weights.describe()}", file=sys.stderr, flush=True)
        loaded = generation.load_run_model(weights, args.device)
        pieces = generation.stream_reply(loaded, args.prompt, settings)
    except (ConfigError, CheckpointError) as err:  # refused before any token: one line, exit 2
        print(f"workbench generate: {err}", file=sys.stderr, flush=True)
        return 2
    except Exception as err:  # noqa: BLE001 - failed while loading the weights: one line, exit 1
        what = f"loading {weights.path}" if weights is not None else f"looking up run {args.run}"
        print(f"workbench generate: failed {what}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    wrote = False
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
            wrote = True
    except BrokenPipeError:
        raise  # the reader went away (`| head`): workbench.cli ends quietly
    except Exception as err:  # noqa: BLE001 - failed while generating: one line, exit 1
        if wrote:
            sys.stdout.write("\n")  # the error's line starts on its own
        print(f"workbench generate: failed while generating: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if wrote:
        sys.stdout.write("\n")
    else:
        print(
            "workbench generate: the reply is empty (the model's first token ended it); try another prompt, "
            "a temperature above 0, or --no-chat-template",
            file=sys.stderr,
        )
    return 0
