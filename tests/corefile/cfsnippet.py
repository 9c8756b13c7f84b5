"""Directives from a Corefile fragment, for plugin setup tests that do not need the whole
Corefile reader: `directive('hosts f {\\n ttl 5\\n}')` -> Directive('hosts', ...), each token
with file `Corefile` and its line. Quotes group a token (`\\"` escapes), `#` starts a comment,
a `{` ending a line opens a block that a `}` line closes."""
from __future__ import annotations

import re

from clusterdns.corefile.syntax import Directive, Token

_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|(#.*)|(\S+)')


def _tokens(line: str, number: int, file: str) -> list[Token]:
    out = []
    for m in _TOKEN.finditer(line):
        if m.group(2) is not None:
            break
        if m.group(1) is not None:
            out.append(Token(re.sub(r'\\(.)', r'\1', m.group(1)), file, number, quoted=True))
        else:
            out.append(Token(m.group(3), file, number))
    return out


def directives(text: str, file: str = "Corefile", first_line: int = 1) -> list[Directive]:
    stack: list[list[Directive]] = [[]]
    opened: list[Directive] = []
    for i, raw in enumerate(text.splitlines()):
        toks = _tokens(raw, first_line + i, file)
        if not toks:
            continue
        if len(toks) == 1 and toks[0].text == "}" and not toks[0].quoted:
            stack.pop()
            opened.pop()
            continue
        opens = toks[-1].text == "{" and not toks[-1].quoted
        if opens:
            toks = toks[:-1]
        d = Directive(toks[0].text, toks[1:], None, file, toks[0].line)
        stack[-1].append(d)
        if opens:
            d.body = []
            stack.append(d.body)
            opened.append(d)
    assert not opened, "unclosed block"
    return stack[0]


def directive(text: str, file: str = "Corefile", first_line: int = 1) -> Directive:
    (d,) = directives(text, file, first_line)
    return d
