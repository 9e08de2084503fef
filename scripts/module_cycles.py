#!/usr/bin/env python3
"""Import cycles between the modules of one Rust crate.

    scripts/module_cycles.py crates/fabric/src [--under memory]

A module is a file (`a.rs` or `a/mod.rs` is module `a`). An edge A -> B is a path A names in a
`use` declaration or inline (`crate::x::y`, `super::z`, `self::w`), resolved to the longest
module prefix that exists. A child's `mod` declaration in its parent is not an edge, so a parent
that declares a child and a child that imports from its parent is no cycle; a parent that also
imports from the child is. Prints every strongly connected component of more than one module
(each is a cycle) and exits 1 if there is one. Macros, `#[path]` and inline `mod x { }` blocks
are not followed: the check reads the source as text, which is what this crate needs.
"""
import os
import re
import sys


def modules(src):
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            mods[tuple(rel)] = os.path.join(dirpath, f)
    return mods


PATH = re.compile(r"\b((?:crate|super|self)(?:::\w+)+)")
USE = re.compile(r"\buse\s+([^;]+);", re.S)


def paths(text):
    text = re.sub(r"//[^\n]*", "", text)
    out = set(PATH.findall(text))
    for body in USE.findall(text):
        # Expand one level of braces: `use super::{a, b::c}` -> super::a, super::b::c.
        m = re.match(r"\s*([\w:]+)::\{(.*)\}\s*$", body, re.S)
        if m:
            for part in m.group(2).split(","):
                part = part.strip().split(" as ")[0].strip()
                if part and part != "self" and not part.startswith("{"):
                    out.add(m.group(1) + "::" + re.sub(r"::\{.*", "", part, flags=re.S))
    return out


def resolve(mod, path, mods):
    parts = path.split("::")
    if parts[0] == "crate":
        base, rest = (), parts[1:]
    else:
        base = list(mod)
        while parts and parts[0] in ("super", "self"):
            if parts[0] == "super":
                base = base[:-1]
            parts = parts[1:]
        base, rest = tuple(base), parts
    best = base if base in mods else None
    for i in range(len(rest)):
        cand = base + tuple(rest[: i + 1])
        if cand in mods:
            best = cand
    return best


def sccs(graph):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    src = sys.argv[1]
    under = tuple(sys.argv[3].split("::")) if len(sys.argv) > 3 and sys.argv[2] == "--under" else ()
    mods = modules(src)
    graph = {}
    for mod, f in mods.items():
        if mod[: len(under)] != under:
            continue
        text = open(f, encoding="utf-8").read()
        for p in paths(text):
            t = resolve(mod, p, mods)
            if t is not None and t != mod and t[: len(under)] == under:
                graph.setdefault(mod, set()).add(t)
        graph.setdefault(mod, set())
    cycles = [sorted(c) for c in sccs(graph) if len(c) > 1]
    name = lambda m: "::".join(m) or "(crate root)"
    for c in sorted(cycles, key=len):
        print(f"cycle of {len(c)} modules: " + ", ".join(name(m) for m in c))
    print(f"{len(graph)} modules, {len(cycles)} cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
