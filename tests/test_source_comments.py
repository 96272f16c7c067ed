"""Comments a reader can follow: no citation of a file outside the repository, no numbered stretch of work cited
instead of what was measured, shape suffixes with a legend."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("workbench", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))
# A tensor name with a shape suffix of two or more dimensions: x_TD, weight_EKN, logits_BSV.
SHAPED = re.compile(r"\b[a-z][a-z0-9]*_[A-Z][A-Z0-9]{1,4}\b")
LEGEND = "# Shape suffixes:"
# A numbered stretch of work or its artifacts: the word session or issue with a number, a one-off launch script named
# after a session, a results file or a device call named by one (an s, the number and a letter). A reader cannot look
# those up: a finding says what was measured, on what, when, and the figure.
NUMBERED_WORK = re.compile(
    r"\bsessions?[ _-]?\d+|\bissues?[ _-]?\d{1,3}\b|gpu_(?:session)|-s\d{1,2}[a-z]?\.jsonl?\b|\bs\d{1,2}[a-z]\b",
    re.IGNORECASE,
)


def test_no_comment_cites_facts_md():
    """facts.md is the workbench sessions' notes, not part of the repository: a citation of it leads nowhere."""
    citing = [
        str(p.relative_to(ROOT))
        for p in SOURCES + [ROOT / "benchmarks" / "NOTES.md"]
        if "facts.md" in p.read_text(encoding="utf-8") and p.name != Path(__file__).name
    ]
    assert citing == []


def test_modules_with_shape_suffixes_define_them():
    """One legend line per module that names tensors by shape (T tokens, D hidden, ...)."""
    missing = [
        str(p.relative_to(ROOT))
        for p in SOURCES
        if SHAPED.search(p.read_text(encoding="utf-8")) and LEGEND not in p.read_text(encoding="utf-8")
    ]
    assert missing == []


def _repository_files() -> list[Path]:
    """Every file git tracks or would track (untracked, not ignored); without git, the repository's own folders."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        return [ROOT / name for name in listed]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "node_modules", "__pycache__", ".ipynb_checkpoints"}
        return [
            p
            for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts) and "egg-info" not in str(p)
        ]


def test_no_file_cites_a_numbered_session_or_issue():
    """README, code, comments, tests, notebooks, benchmark notes and results say what was measured, not where."""
    citing = []
    for path in _repository_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # images and other binary files
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found = NUMBERED_WORK.search(line)
            if found:
                citing.append(f"{path.relative_to(ROOT)}:{number}: {found.group(0)!r}")
    assert citing == []


def test_numbered_work_pattern_catches_each_form():
    """The pattern above finds every form such a citation took, and leaves code's own names alone."""
    # assembled from parts, so that this file passes the scan above too
    session, issue, number = "session", "issue", "19"
    cited = [
        f"measured in {session} {number}",
        f"({issue} 14 item 6)",
        f"{issue.title()} 7",
        f"benchmarks/gpu_{session}{number}h.sh",
        f"results/2026-12-04-1xh200-qwen3-L8-4096x2-s{number}h.json",
        f"s{number}a's trace",
        f"the {session}-{number} call",
    ]
    plain = ["s1, s2 = c1, s1", "B2 S4096", "an issue rate of one warp instruction", "a session's device time"]
    assert [text for text in cited if not NUMBERED_WORK.search(text)] == []
    assert [text for text in plain if NUMBERED_WORK.search(text)] == []
