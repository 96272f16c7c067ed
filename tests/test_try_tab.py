"""The Studio's Try tab without a browser: the run picker, a Send streamed into the reply, refusals said in the tab."""

import html
import os
import shutil
import time

import pytest
from tiny_runs import train_tiny_run

import workbench
from workbench.config import RunConfig
from workbench.runs.run_dir import RunDir
from workbench.ui.try_logic import NO_RUNS, Replier, read_settings, run_choices

PROMPT = "What does a router do?"


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """A runs directory: "trained" (export + step 3), "older" (its copy without the export, saved earlier), "fresh"
    (no weights yet)."""
    root = tmp_path_factory.mktemp("try") / "runs"
    trained = train_tiny_run(root, "trained")
    older = root / "older"
    shutil.copytree(trained, older)
    shutil.rmtree(older / "hf")
    past = time.time() - 3600
    os.utime(older / "checkpoints" / "step-00000003", (past, past))
    RunDir.create(root, "fresh", RunConfig.demo().to_dict())
    return root


def test_picker_lists_runs_with_weights_latest_first(runs_dir):
    choices = run_choices(runs_dir)
    assert [c.run_dir for c in choices] == [str(runs_dir / "trained"), str(runs_dir / "older")]  # "fresh": none yet
    assert [c.label for c in choices] == ["trained · export", "older · step 3"]
    assert run_choices(runs_dir / "missing") == []


def _send(replier, run_dir, prompt, settings):
    replies, statuses = [], []
    text = replier.send(run_dir, prompt, settings, replies.append, statuses.append)
    return text, replies, statuses


def test_send_streams_the_reply_workbench_generate_gives(runs_dir):
    replier = Replier(device="cpu")
    settings = lambda: read_settings(12, 0.0, 0.9, -1)  # noqa: E731 - greedy, no seed
    text, replies, statuses = _send(replier, str(runs_dir / "older"), PROMPT, settings)
    assert text and text == workbench.generate(runs_dir / "older", PROMPT, temperature=0, max_new_tokens=12)
    assert replies[0] == "" and replies[-1] == text and len(replies) > 2  # it grew piece by piece
    assert statuses[:2] == ["loading older…", "answering with older · step 3"]
    assert "pieces in" in statuses[-1] and statuses[-1].endswith(" on cpu · older · step 3")
    loaded = replier.loaded
    again, _, _ = _send(replier, str(runs_dir / "older"), PROMPT, settings)
    assert again == text and replier.loaded is loaded  # the same run's model stays loaded
    _send(replier, str(runs_dir / "trained"), PROMPT, settings)
    assert replier.loaded is not loaded and replier.loaded.weights.source == "export"


def test_refusals_are_said_in_the_tab_before_any_load(runs_dir):
    replier = Replier(device="cpu")
    run = str(runs_dir / "trained")
    for run_dir, prompt, settings, said in (
        ("", PROMPT, lambda: read_settings(12, 0.0, 0.9, -1), NO_RUNS),
        (run, "  ", lambda: read_settings(12, 0.0, 0.9, -1), "the prompt must be a non-empty string"),
        (run, PROMPT, lambda: read_settings(0, 0.0, 0.9, -1), "max_new_tokens must be an integer >= 1"),
        (run, PROMPT, lambda: read_settings(12, 0.0, 0.0, -1), "top_p must be > 0"),
        (str(runs_dir / "fresh"), PROMPT, lambda: read_settings(12, 0.0, 0.9, -1), "has no weights yet"),
    ):
        text, replies, statuses = _send(replier, run_dir, prompt, settings)
        assert text == "" and replies == [""]
        assert statuses[-1].startswith("refused: ") and said in statuses[-1], statuses
    assert replier.loaded is None


def test_try_tab_defaults_to_the_latest_run_and_streams_into_its_reply(runs_dir):
    pytest.importorskip("ipywidgets")
    from workbench.ui.try_tab import TryTab

    tab = TryTab(runs_dir, device="cpu")
    assert tab.run.value == str(runs_dir / "trained")
    assert [label for label, _ in tab.run.options] == ["trained · export", "older · step 3"]
    tab.prompt.value = PROMPT
    tab.temperature.value, tab.max_new_tokens.value = 0.0, 12
    tab.send(wait=True)
    expected = workbench.generate(runs_dir / "trained", PROMPT, temperature=0, max_new_tokens=12)
    assert f">{html.escape(expected)}</pre>" in tab.reply.value
    assert "pieces in" in tab.status.value and not tab.send_button.disabled

    empty = TryTab(runs_dir / "missing", device="cpu")
    assert empty.run.options == ((NO_RUNS, ""),)
    empty.prompt.value = PROMPT
    empty.send(wait=True)
    assert "refused: " + NO_RUNS in empty.status.value


def test_studio_has_the_try_tab(runs_dir):
    pytest.importorskip("ipywidgets")
    from workbench.ui import Studio

    studio = Studio(None, runs_dir=runs_dir)
    assert [studio.tabs.get_title(i) for i in range(len(studio.tabs.children))][-1] == "Try"
    assert studio.tabs.children[-1] is studio.try_tab.widget
    assert studio.try_tab.run.value == str(runs_dir / "trained")
