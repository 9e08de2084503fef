#!/usr/bin/env python3
"""The README settings table, generated from settings/settings.tsv (the one declaration of every
spark.shuffle.rdma.* setting), and Mobius' table, generated from settings/mobius.tsv (every
MOBIUS_* environment setting).

A document holds a table between two marker lines:
    <!-- settings:begin -->            (or <!-- mobius-settings:begin --> for Mobius' table)
    ...generated...
    <!-- settings:end -->              (or <!-- mobius-settings:end -->)

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
MOBIUS_SCHEMA = Path(__file__).resolve().parent / "mobius.tsv"
MOBIUS_HEADER = ["key", "type", "default", "range", "doc"]


def rows(schema: Path = SCHEMA, header: list = HEADER) -> list:
    lines = [ln for ln in schema.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if lines[0].split("\t") != header:
        sys.exit(f"{schema}: the first row must be the header {header}")
    out = []
    for n, ln in enumerate(lines[1:], 2):
        cols = ln.split("\t")
        if len(cols) != len(header):
            sys.exit(f"{schema}: row {n} has {len(cols)} columns, expected {len(header)}")
        out.append(dict(zip(header, cols)))
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


def choices(rng: str) -> str:
    return " \\| ".join(code(c) for c in rng.split("|"))


def bounded(unit: str, rng: str) -> str:
    """`unit lo–hi`, `unit ≥ lo` or `unit ≤ hi` from a `lo..hi` range."""
    lo, hi = rng.split("..")
    if lo and hi:
        return f"{unit} {code(lo)}–{code(hi)}"
    return f"{unit} ≥ {code(lo)}" if lo else f"{unit} ≤ {code(hi)}"


def allowed_cell(r: dict) -> str:
    kind, rng = r["type"], r["range"]
    if kind == "bool":
        return "`true` \\| `false`"
    if kind == "choice":
        return choices(rng)
    if kind == "host":
        return "an address or host name"
    if rng == "-":
        return {"string": "a name"}.get(kind, "any " + kind)
    return bounded({"size": "size", "sizes": "sizes, ascending, each", "duration": "duration",
                    "int": "integer"}[kind], rng)


def table() -> str:
    out = ["| setting | default | allowed | meaning |", "|---|---|---|---|"]
    for r in rows():
        doc = r["doc"].replace("|", "\\|")
        out.append(f"| {code(r['key'])} | {default_cell(r)} | {allowed_cell(r)} | {doc} |")
    return "\n".join(out) + "\n"


def mobius_allowed(r: dict) -> str:
    kind, rng = r["type"], r["range"]
    if kind == "bool":
        return "`on` \\| `off`"
    if kind == "choice":
        return choices(rng)
    if kind == "address":
        return "an IP address"
    if kind in ("seconds", "size") and rng != "-":
        return bounded({"seconds": "seconds", "size": "size (`64k`, `16m`, `1g`)"}[kind], rng)
    return {"spec": "see meaning", "string": "a name"}.get(kind, "any " + kind)


def mobius_table() -> str:
    out = ["| variable | default | allowed | meaning |", "|---|---|---|---|"]
    for r in rows(MOBIUS_SCHEMA, MOBIUS_HEADER):
        doc = r["doc"].replace("|", "\\|")
        default = "unset" if r["default"] == "-" else code(r["default"])
        out.append(f"| {code(r['key'])} | {default} | {mobius_allowed(r)} | {doc} |")
    return "\n".join(out) + "\n"


# Marker name -> the table generated between its markers.
TABLES = {"settings": table, "mobius-settings": mobius_table}


def split(path: Path, name: str = "settings"):
    """(text up to the begin marker, the table, the rest), or None without the markers."""
    text = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    b, e = text.find(begin), text.find(end)
    if b < 0 or e < b:
        return None
    head = text[:b + len(begin)] + "\n"
    return head, text[len(head):e], text[e:]


def main(argv: list) -> int:
    if not argv:
        sys.stdout.write(table())
        return 0
    mode, files = argv[0], [Path(f) for f in argv[1:]]
    if mode not in ("--write", "--check") or not files:
        sys.exit(__doc__)
    failed = False
    for f in files:
        found = False
        for name, make in TABLES.items():
            parts = split(f, name)
            if parts is None:
                continue
            found = True
            head, have, tail = parts
            want = make()
            if mode == "--write":
                f.write_text(head + want + tail)
            elif have != want:
                failed = True
                sys.stderr.write(f"{f}: the {name} table differs from its schema; run "
                                 f"settings/readme_table.py --write {f}\n")
                sys.stderr.writelines(difflib.unified_diff(
                    have.splitlines(True), want.splitlines(True), f"{f} (table)", "schema"))
        if not found:
            sys.exit(f"{f}: no '{BEGIN}' ... '{END}' block (nor a mobius-settings one) for a settings "
                     f"table (add the two marker lines, then run {sys.argv[0]} --write {f})")
    if mode == "--check" and not failed:
        print(f"settings tables match their schemas (settings/*.tsv): {', '.join(map(str, files))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
