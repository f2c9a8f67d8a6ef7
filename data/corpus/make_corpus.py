#!/usr/bin/env python3
"""Builds rust-book-prose.txt, the English corpus of `tandem bench quant`'s perplexity column.

Source: "The Rust Programming Language" (the Rust Book) by Steve Klabnik, Carol Nichols and Chris
Krycho, with contributions from the Rust Community, as shipped in the `rust-docs` component of
the Rust 1.95.0 toolchain (share/doc/rust/html/book). Licence: MIT OR Apache-2.0 (the licence of
the Rust Book's repository, rust-lang/book, and the Rust project's default, see the toolchain's
share/doc/rust/COPYRIGHT.html). What this keeps: the running prose of chapters 3, 4 and 8 -- every <p> paragraph in
order, inline markup removed, code blocks, lists, tables and headings left out.

Run: python3 make_corpus.py [path/to/share/doc/rust/html/book] > rust-book-prose.txt
"""
import glob
import html
import os
import re
import sys

CHAPTERS = ["ch03", "ch04", "ch08"]


def main():
    book = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser(
        "~/.rustup/toolchains/1.95.0-x86_64-unknown-linux-gnu/share/doc/rust/html/book")
    paragraphs = []
    for ch in CHAPTERS:
        for path in sorted(glob.glob(os.path.join(book, ch + "-*.html"))):
            text = open(path, encoding="utf-8").read()
            main = re.search(r"<main>(.*)</main>", text, re.S)
            body = main.group(1) if main else text
            for p in re.findall(r"<p>(.*?)</p>", body, re.S):
                if "<pre" in p or "class=\"warning\"" in p:
                    continue
                p = re.sub(r"<[^>]+>", "", p)
                p = html.unescape(p)
                p = re.sub(r"\s+", " ", p).strip()
                # Only sentences of prose: skip captions ("Listing 3-1: ...") and stubs.
                if len(p) < 80 or p.startswith("Listing ") or p.startswith("Filename:"):
                    continue
                paragraphs.append(p)
    sys.stdout.write("\n\n".join(paragraphs) + "\n")


if __name__ == "__main__":
    main()
