#!/usr/bin/env python3
"""The README settings table, generated from settings/settings.tsv (the one declaration of every
spark.shuffle.rdma.* setting).

A document holds the table between two marker lines:
    <!-- settings:begin -->
    ...generated...
    <!-- settings:end -->

    settings/readme_table.py                  print the table
    settings/readme_table.py --write FILE...  regenerate the table between the markers
    settings/readme_table.py --check FILE...  fail (with a diff) when a table differs from the
                                              schema, or a file has no markers
"""
import difflib
import sys
from pathlib import Path

SCHEMA = Path(__file__).resolve().parent / "settings.tsv"
BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
HEADER = ["key", "type", "default", "fallback", "range", "scope", "doc"]


def rows() -> list:
    lines = [ln for ln in SCHEMA.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if lines[0].split("\t") != HEADER:
        sys.exit(f"{SCHEMA}: the first row must be the header {HEADER}")
    out = []
    for n, ln in enumerate(lines[1:], 2):
        cols = ln.split("\t")
        if len(cols) != len(HEADER):
            sys.exit(f"{SCHEMA}: row {n} has {len(cols)} columns, expected {len(HEADER)}")
        out.append(dict(zip(HEADER, cols)))
    return out


def code(s: str) -> str:
    return f"`{s}`"


def default_cell(r: dict) -> str:
    chain = [] if r["fallback"] == "-" else r["fallback"].split(",")
    if "@executorHost" in chain:
        return "the executor's host"
    parts = [code(k) for k in chain]
    parts.append("unset" if r["default"] == "-" else code(r["default"]))
    return ", else ".join(parts)


def allowed_cell(r: dict) -> str:
    kind, rng = r["type"], r["range"]
    if kind == "bool":
        return "`true` \\| `false`"
    if kind == "choice":
        return " \\| ".join(code(c) for c in rng.split("|"))
    if kind == "host":
        return "an address or host name"
    if rng == "-":
        return {"string": "a name"}.get(kind, "any " + kind)
    lo, hi = rng.split("..")
    unit = {"size": "size", "sizes": "sizes, ascending, each", "duration": "duration",
            "int": "integer"}[kind]
    if lo and hi:
        return f"{unit} {code(lo)}–{code(hi)}"
    return f"{unit} ≥ {code(lo)}" if lo else f"{unit} ≤ {code(hi)}"


def table() -> str:
    out = ["| setting | default | allowed | meaning |", "|---|---|---|---|"]
    for r in rows():
        doc = r["doc"].replace("|", "\\|")
        out.append(f"| {code(r['key'])} | {default_cell(r)} | {allowed_cell(r)} | {doc} |")
    return "\n".join(out) + "\n"


def split(path: Path):
    text = path.read_text()
    b, e = text.find(BEGIN), text.find(END)
    if b < 0 or e < b:
        sys.exit(f"{path}: no '{BEGIN}' ... '{END}' block for the settings table "
                 f"(add the two marker lines, then run {sys.argv[0]} --write {path})")
    head = text[:b + len(BEGIN)] + "\n"
    return head, text[len(head):e], text[e:]


def main(argv: list) -> int:
    if not argv:
        sys.stdout.write(table())
        return 0
    mode, files = argv[0], [Path(f) for f in argv[1:]]
    if mode not in ("--write", "--check") or not files:
        sys.exit(__doc__)
    want = table()
    failed = False
    for f in files:
        head, have, tail = split(f)
        if mode == "--write":
            f.write_text(head + want + tail)
        elif have != want:
            failed = True
            sys.stderr.write(f"{f}: the settings table differs from settings/settings.tsv; run "
                             f"settings/readme_table.py --write {f}\n")
            sys.stderr.writelines(difflib.unified_diff(
                have.splitlines(True), want.splitlines(True), f"{f} (table)", "settings.tsv"))
    if mode == "--check" and not failed:
        print(f"settings tables match settings/settings.tsv: {', '.join(map(str, files))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
