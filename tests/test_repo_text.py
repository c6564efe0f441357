"""The repo's text speaks of the product, not of its making: no numbered work periods, run numbers,
issue numbers or run-suffixed record names in tracked source and docs (history is git's job)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GLOBS = ("*.py", "*.md", "*.sh", "*.yaml", "*.toml")
_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
PATTERNS = (
    re.compile(rf"\b({_ORDINALS})[- ]sessions?\b", re.I),  # an ordinal work period
    re.compile(r"\b(this|last|next|earlier|previous)[- ]session\b", re.I),
    re.compile(r"\b(earlier|previous) sessions\b", re.I),
    re.compile(r"\bsessions? #?[0-9]", re.I),  # a numbered one
    re.compile(r"\bissues? #?[0-9]", re.I),  # an issue number
    # a run number; not a --runs flag nor "runs 4% behind"
    re.compile(r"(?<![-\w])run [0-9]+\b(?!\s*%)", re.I),
    re.compile(r"_s[0-9]+(run|machine|final|ab|x[0-9])"),  # run-suffixed record names
    re.compile(r"_s[0-9]+(\.(json|txt|md)\b|[*`])"),  # ... and their globs
)


def tracked_text_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--", *GLOBS], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def history_hits(path: str, text: str) -> list[str]:
    return [
        f"{path}:{n}: {line.strip()[:120]}"
        for n, line in enumerate(text.splitlines(), 1)
        if any(p.search(line) for p in PATTERNS)
    ]


# Built from pieces, so that this file's own text holds none of them.
S, R = "session", "run"
HISTORY = [
    f"the ninth {S}'s final code",
    f"in the fourth and fifth {S}s",
    "built (issue" + " 4)",
    f"measured after {R} 6 of the {S}",
    "records kernels_*_s" + "9machine2.json",
    "disagg_ttft_trace_report_s" + "8run3.txt",
    f"this {S}'s change",
    "the same code: kernels_table_s" + "10.md",
    "records `*_s" + "10`",
]


@pytest.mark.parametrize("line", HISTORY)
def test_history_is_caught(line: str) -> None:
    assert history_hits("x.md", line)


@pytest.mark.parametrize(
    "line",
    [
        "subprocess.Popen(cmd, start_new_session=True)",
        '@pytest.fixture(scope="session")',
        "this hook sees the whole session's items",
        "a client's HTTP sessions share one pool",
        "`pdserve up` runs in its own session",
        "python3 -m bench.disagg --runs 7 --gap-ms 0 50",
        "a loop that runs 4% behind 64-key tiles",
        "every step runs 2 kernels",
        "max_s1 = 3; key_s",
    ],
)
def test_product_text_is_not_flagged(line: str) -> None:
    assert not history_hits("x.py", line)


def test_the_tree_has_no_history() -> None:
    files = tracked_text_files()
    assert "BENCHMARKS.md" in files
    hits = [
        hit
        for path in files
        for hit in history_hits(path, (ROOT / path).read_text(encoding="utf-8", errors="replace"))
    ]
    assert not hits, "history in the repo's text (say what is true now; git keeps the past):\n" + "\n".join(
        hits
    )
