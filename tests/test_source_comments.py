"""Comments a reader can follow: no citation of a file outside the repository, shape suffixes with a legend."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("workbench", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))
# A tensor name with a shape suffix of two or more dimensions: x_TD, weight_EKN, logits_BSV.
SHAPED = re.compile(r"\b[a-z][a-z0-9]*_[A-Z][A-Z0-9]{1,4}\b")
LEGEND = "# Shape suffixes:"


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
