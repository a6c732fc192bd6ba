#!/usr/bin/env python3
"""gdr-core's public API as a list of names, from its rustdoc pages.

Stable Rust has no machine-readable rustdoc output, so this reads the HTML
that `cargo doc` writes: every item on the crate's all.html (its kind and
path), and on each item's page the members declared on it: fields,
variants, inherent methods and associated items, and a trait's required
and provided methods (not what trait implementations add: those follow
the toolchain's blanket impls, not our code). One line per name, sorted.

Usage:
  scripts/public-api.py DOC_DIR            print the list (DOC_DIR: target/doc/gdr_core)
  scripts/public-api.py DOC_DIR --check F  fail, with the difference, where F differs
  scripts/public-api.py DOC_DIR --bless F  write the list to F
"""
import html
import os
import re
import sys

ITEM = re.compile(r'<li><a href="([^"]+)">([^<]+)</a></li>')
# The kind of an item page from its file name: struct.Name.html.
KIND = re.compile(r'(?:^|/)(\w+)\.[^/]+\.html$')
MEMBER = re.compile(
    r'id="(structfield|variant|method|tymethod|associatedconstant|associatedtype)\.([A-Za-z0-9_]+)"'
)
# Where the members an item declares end and trait implementations begin.
IMPL_SECTIONS = ("id=\"trait-implementations\"", "id=\"synthetic-implementations\"",
                 "id=\"blanket-implementations\"", "id=\"implementors\"",
                 "id=\"foreign-impls\"", "id=\"object-safety\"", "id=\"dyn-compatibility\"")


def declared(page: str) -> str:
    """The part of an item page before its trait implementations."""
    cut = len(page)
    for marker in IMPL_SECTIONS:
        at = page.find(marker)
        if at != -1:
            cut = min(cut, at)
    return page[:cut]


def public_api(doc_dir: str) -> list[str]:
    crate = os.path.basename(os.path.normpath(doc_dir))
    all_items = open(os.path.join(doc_dir, "all.html"), encoding="utf-8").read()
    lines = set()
    for href, name in ITEM.findall(all_items):
        kind = KIND.search(href)
        kind = kind.group(1) if kind else "item"
        path = f"{crate}::{html.unescape(name)}"
        lines.add(f"{kind} {path}")
        page_path = os.path.join(doc_dir, href)
        if not os.path.exists(page_path):
            continue
        page = declared(open(page_path, encoding="utf-8").read())
        for member_kind, member in MEMBER.findall(page):
            lines.add(f"{member_kind} {path}::{member}")
    return sorted(lines)


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    lines = public_api(sys.argv[1])
    members = ("structfield ", "variant ", "method ", "tymethod ", "associatedconstant ",
               "associatedtype ")
    items = sum(1 for line in lines if not line.startswith(members))
    text = "".join(line + "\n" for line in lines)
    if len(sys.argv) == 2:
        sys.stdout.write(text)
        return 0
    mode, committed = sys.argv[2], sys.argv[3]
    if mode == "--bless":
        open(committed, "w", encoding="utf-8").write(text)
        print(f"public-api: {items} item pages, {len(lines)} names written to {committed}")
        return 0
    if mode != "--check":
        print(__doc__, file=sys.stderr)
        return 2
    before = open(committed, encoding="utf-8").read().splitlines()
    gone = sorted(set(before) - set(lines))
    new = sorted(set(lines) - set(before))
    if not gone and not new:
        print(f"public-api: {items} item pages, {len(lines)} names, as committed in {committed}")
        return 0
    print(f"public-api: gdr-core's public API differs from {committed}:")
    for line in gone:
        print(f"  - {line}")
    for line in new:
        print(f"  + {line}")
    print("If the change is meant, run scripts/public-api.sh --bless and commit the list.")
    return 1


if __name__ == "__main__":
    sys.exit(main())
