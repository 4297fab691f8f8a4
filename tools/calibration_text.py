#!/usr/bin/env python3
"""Regenerate data/calibration/python-idle-help.txt: the plain text of the
IDLE chapter of the Python documentation (idlelib/help.html, shipped with
every CPython install), used as the calibration text of `rknot calibrate`.

Why this text: English prose (not code, not a license), offline on any
machine with Python, and redistributable: the Python documentation is
licensed under the PSF License Version 2 (see NOTICE beside the text).
It is neither evaluation text (GPL-3, nor the second, another license text).

Usage: tools/calibration_text.py [HELP_HTML] > data/calibration/python-idle-help.txt
(default HELP_HTML: idlelib/help.html of the running python3).
"""
import html.parser
import os
import re
import sys


class Body(html.parser.HTMLParser):
    """Text inside <div class="body" role="main">, a blank line between
    blocks; the navigation, sidebar and footer are left out."""

    BLOCKS = {"p", "li", "dt", "dd", "h1", "h2", "h3", "h4", "pre", "tr", "div", "section"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0  # div nesting inside the body div (0: outside)
        self.out = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self.depth == 0:
            if tag == "div" and a.get("role") == "main":
                self.depth = 1
            return
        if tag == "div":
            self.depth += 1
        if tag in self.BLOCKS:
            self.out.append("\n\n")

    def handle_endtag(self, tag):
        if self.depth == 0:
            return
        if tag in self.BLOCKS:
            self.out.append("\n\n")
        if tag == "div":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth > 0:
            self.out.append(data)


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.__file__), "idlelib", "help.html")
    with open(src, encoding="utf-8") as f:
        p = Body()
        p.feed(f.read())
    text = "".join(p.out).replace("\u00b6", "")  # Sphinx's pilcrow anchors
    paras = []
    for block in re.split(r"\n\s*\n", text):
        line = " ".join(block.split())
        if line:
            paras.append(line)
    sys.stdout.write("\n\n".join(paras) + "\n")


if __name__ == "__main__":
    main()
