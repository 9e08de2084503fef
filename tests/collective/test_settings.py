"""settings/mobius.tsv declares every MOBIUS_* setting: each name the code reads is declared,
and each declared name is read somewhere (no stale rows). (The defaults are checked against
the Rust config by `cargo test -p mobius-collective defaults_match_the_settings_schema`.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
# Variables of the test and build scripts, not of Mobius.
NOT_SETTINGS = {"MOBIUS_VENV", "MOBIUS_SKIP_BUILD", "MOBIUS_FEATURES", "MOBIUS_PY"}


def declared() -> set:
    lines = (ROOT / "settings" / "mobius.tsv").read_text().splitlines()
    return {ln.split("\t")[0] for ln in lines if ln.strip() and not ln.startswith("#")} - {"key"}


def read_by_code() -> set:
    names = set()
    for d in ("crates/collective/src", "crates/collective-py/src", "crates/collective-py/python"):
        for f in (ROOT / d).rglob("*"):
            if f.suffix in (".rs", ".py"):
                names |= set(re.findall(r"\bMOBIUS_[A-Z][A-Z_]*[A-Z]\b", f.read_text()))
    return names - NOT_SETTINGS


def provider_settings(schema: set) -> set:
    """`MOBIUS_<PROVIDER>_<NAME>` of a provider in MOBIUS_TRANSPORT's values: read by the
    collective's generic `provider_settings` (comm/config.rs) and handed to that provider as
    `<provider>.<name>`, so no code names them."""
    row = next(ln for ln in (ROOT / "settings" / "mobius.tsv").read_text().splitlines()
               if ln.startswith("MOBIUS_TRANSPORT\t"))
    providers = [p.upper() for p in row.split("\t")[3].split("|") if p != "auto"]
    return {k for k in schema if any(k.startswith(f"MOBIUS_{p}_") for p in providers)}


def test_every_mobius_setting_the_code_reads_is_declared_and_none_is_stale():
    code, schema = read_by_code(), declared()
    code |= provider_settings(schema)
    assert not code - schema, f"read by the code but not declared in settings/mobius.tsv: {sorted(code - schema)}"
    assert not schema - code, f"declared in settings/mobius.tsv but read nowhere: {sorted(schema - code)}"
