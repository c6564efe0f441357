"""One JSON record per measured figure in bench/results/, so anyone can re-run it.

BENCHMARKS.md is the table a person reads; these files are the raw records behind it.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import shlex
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def record(
    name: str,
    value: float,
    unit: str,
    *,
    ceiling: float | None = None,
    ceiling_name: str | None = None,
    baseline: float | None = None,
    baseline_name: str | None = None,
    baseline_ratio: float | None = None,
    ratio: float | None = None,
    goal: str | None = None,
    extra: dict | None = None,
    out_dir: Path | None = None,
    command: str | None = None,
) -> dict:
    """Write bench/results/<name>.json (or into out_dir) and return the record."""
    if ratio is None and ceiling:
        ratio = value / ceiling
    if ratio is None and baseline:
        ratio = value / baseline
    rec = {
        "name": name,
        "value": value,
        "unit": unit,
        "ceiling": ceiling,
        "ceiling_name": ceiling_name,
        "baseline": baseline,
        "baseline_name": baseline_name,
        "ratio": ratio,
        **({"baseline_ratio": baseline_ratio} if baseline_ratio is not None else {}),
        "goal": goal,
        "device": device_name(),
        "date": _dt.date.today().isoformat(),
        "command": command or " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        **({"extra": extra} if extra else {}),
    }
    target = out_dir or RESULTS_DIR
    target.mkdir(parents=True, exist_ok=True)
    fname = re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".json"
    (target / fname).write_text(json.dumps(rec, indent=2) + "\n")
    return rec
