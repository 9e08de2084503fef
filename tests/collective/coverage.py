"""The c10d coverage table of docs/mobius.md, measured: the same matrix (worker.py
`torch_matrix`: every collective × dtype × reduce op, checked against numpy) under mobius and
under gloo, on 2 ranks, and a markdown table of what each backend got right.

    coverage.py [--out target/bench]     prints the tables; writes coverage.json

A cell reads `mobius gloo`: ✓ correct, ✗ refused with an error, ! ran but gave wrong data.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import run  # noqa: E402

# As worker.py's TORCH_DTYPES and REDUCE_OPS (worker.py runs as a rank and needs RANK to import).
TORCH_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
REDUCE_OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]

REDUCING = ["all_reduce", "reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor"]
MOVING = ["broadcast", "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter",
          "all_to_all_single", "all_to_all_single_uneven", "all_to_all"]
SHORT = {"bool": "bool", "uint8": "u8", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
         "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def mark(status: dict, key: str) -> str:
    s = status.get(key, "missing")
    if s.startswith("ok"):
        return "✓"
    if s.startswith("refused"):
        return "✗"
    return "!"


def tables(res: dict) -> str:
    m, g = res["mobius"], res["gloo"]
    head = "| | " + " | ".join(SHORT[d] for d in TORCH_DTYPES) + " |\n|---|" + "---|" * len(TORCH_DTYPES) + "\n"
    out = ["Reduce ops (all_reduce; cell: mobius gloo)\n\n" + head]
    for op in REDUCE_OPS:
        cells = [f"{mark(m, f'all_reduce {d} {op}')} {mark(g, f'all_reduce {d} {op}')}" for d in TORCH_DTYPES]
        out.append(f"| {op} | " + " | ".join(cells) + " |\n")
    # Where another reducing collective differs from all_reduce, say so.
    notes = []
    for name in REDUCING[1:]:
        for who, st in (("mobius", m), ("gloo", g)):
            diff = [f"{d} {op}" for d in TORCH_DTYPES for op in REDUCE_OPS
                    if mark(st, f"{name} {d} {op}") != mark(st, f"all_reduce {d} {op}")]
            if diff:
                notes.append(f"- {name} under {who} differs from all_reduce on: {', '.join(diff)}")
    out.append("\n" + ("\n".join(notes) if notes else "Every reducing collective (" + ", ".join(REDUCING[1:])
                       + ") matches all_reduce's row for both backends.") + "\n")
    out.append("\nCollectives that move data (cell: mobius gloo)\n\n" + head)
    for name in MOVING:
        cells = [f"{mark(m, f'{name} {d}')} {mark(g, f'{name} {d}')}" for d in TORCH_DTYPES]
        out.append(f"| {name} | " + " | ".join(cells) + " |\n")
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="target/bench")
    a = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("mobius", "gloo"):
            res[backend] = run("torch_matrix", 2, Path(tmp) / backend, {"backend": backend}, timeout=900)[0]["status"]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "coverage.json").write_text(json.dumps(res, indent=1))
    print(tables(res))


if __name__ == "__main__":
    main()
