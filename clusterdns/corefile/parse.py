"""Reading a Corefile into server blocks, as CoreDNS's Caddyfile reader does (coredns/caddy
caddyfile/lexer.go and parse.go), with every token keeping the file and line it came from.

    .:53 {                        -> ServerBlock(keys=[Token('.:53')], directives=[
        forward . 1.1.1.1 {            Directive('forward', args=['.', '1.1.1.1'],
            max_concurrent 1000            body=[Directive('max_concurrent', args=['1000'])])])
        }
    }

Lexing: tokens are separated by whitespace; an unquoted `#` starts a comment to the end of
the line; a token that starts with `"` runs to the next unescaped `"` (only `\\"` is an
escape; newlines may be inside); `{$VAR}` and `{%VAR%}` are replaced in every token.
Structure: a line is the tokens that start on one line; a `{` ending a line opens a block
that a `}` on a later line closes; `import PATTERN` on a line of its own splices in a
snippet's or files' tokens, which keep their own file and line.

Two deliberate differences from caddy, both where caddy would misread silently: a quoted
`"{"` or `"}"` is a literal argument, not a brace; a `{` or `}` among other tokens of a
line (`a { b }` on one line, `fallthrough }`) is an error rather than a half-parsed block.
"""
from __future__ import annotations

import glob
import logging
import os
import re
from typing import Iterable, Mapping

from .syntax import CorefileError, Directive, ServerBlock, Token

log = logging.getLogger(__name__)

MAX_IMPORTS = 10000     # snippet and file imports expanded in one parse (caddy: a hard cap)
MAX_DEPTH = 100         # nested blocks (real Corefiles nest 2 deep; the parser recurses per level)

# Go's unicode.IsSpace, which caddy splits on (Python's \s also takes \x1c-\x1f)
_WS = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# One lexical item per match; whatever matches none of them (whitespace) is skipped.
_LEX = re.compile(r"""
    (?P<nl>\n)
  | (?P<comment>\#[^\n]*)
  | (?P<quoted>"(?:[^"\\]|\\.)*")
  | (?P<open_quote>")
  | (?P<word>[^WS\#"][^WS\#]*)
""".replace("WS", _WS), re.VERBOSE | re.DOTALL)
_ESCAPE = re.compile(r'\\(.)', re.DOTALL)


class _Tok:
    """A token while parsing: `end` is the line it ends on (a quoted token may span lines)."""
    __slots__ = ("text", "file", "line", "end", "quoted")

    def __init__(self, text: str, file: str, line: int, end: int, quoted: bool) -> None:
        self.text, self.file, self.line, self.end, self.quoted = text, file, line, end, quoted

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def is_brace(self, brace: str) -> bool:
        return self.text == brace and not self.quoted

    def __repr__(self) -> str:
        return f"_Tok({self.text!r} {self.where})"


def tokenize(text: str, filename: str = "Corefile") -> list[_Tok]:
    """The tokens of one file's text, in order (no imports, no env substitution)."""
    if text.startswith("\ufeff"):
        text = text[1:]
    out: list[_Tok] = []
    line = 1
    for m in _LEX.finditer(text):
        kind = m.lastgroup
        if kind == "nl":
            line += 1
        elif kind == "word":
            out.append(_Tok(m.group(), filename, line, line, False))
        elif kind == "quoted":
            raw = m.group()[1:-1]
            body = _ESCAPE.sub(lambda e: '"' if e.group(1) == '"' else e.group(0), raw) if "\\" in raw else raw
            breaks = raw.count("\n")
            out.append(_Tok(body, filename, line, line + breaks, True))
            line += breaks
        elif kind == "open_quote":
            raise CorefileError(f"{filename}:{line}", "unterminated quoted string (no closing '\"')")
        # comments: skipped
    return out


def replace_env(text: str, env: Mapping[str, str]) -> str:
    """`{$VAR}` and `{%VAR%}` replaced by the variable's value (unset: empty); a reference
    without its end, or with an empty name, is left as it is (caddy's replaceEnvVars)."""
    if "{" not in text:
        return text
    for start, end in (("{%", "%}"), ("{$", "}")):
        pos = 0
        while True:
            i = text.find(start, pos)
            if i < 0:
                break
            j = text.find(end, i + len(start))
            if j < 0:
                break
            name = text[i + len(start):j]
            if not name:
                break
            value = env.get(name, "")
            text = text[:i] + value + text[j + len(end):]
            pos = i + len(value)   # values are not scanned again (no recursive expansion)
    return text


class _Frame:
    """Tokens being read: the main file's, one imported file's or one snippet's."""
    __slots__ = ("toks", "i", "origin")

    def __init__(self, toks: list[_Tok], origin: str) -> None:
        self.toks, self.i, self.origin = toks, 0, origin


class _Reader:
    """Lines of tokens across imports. A frame stays on the stack until a read goes past its
    end, so while an import at a file's last line is expanded, that file is still an active
    ancestor (which is what the cycle check needs)."""

    def __init__(self, toks: list[_Tok], origin: str, dirs: dict[str, str], env: Mapping[str, str]) -> None:
        self.stack = [_Frame(toks, origin)]
        self.active = {origin: 1}
        self.dirs = dirs            # token file -> directory its relative imports are read from
        self.env = env
        self.snippets: dict[str, list[_Tok]] = {}
        self.files: dict[str, tuple[list[_Tok], str]] = {}   # path -> its tokens, identity
        self.imports = 0
        self.pending: list[_Tok] | None = None

    def _raw_line(self) -> list[_Tok] | None:
        while self.stack:
            f = self.stack[-1]
            if f.i < len(f.toks):
                toks, start = f.toks, f.i
                first = toks[start]
                file, end = first.file, first.end
                j = start + 1
                # caddy's isNewLine: same file, starting on the line the previous token ended on
                while j < len(toks) and toks[j].line == end and toks[j].file == file:
                    end = toks[j].end
                    j += 1
                f.i = j
                return toks[start:j]
            self.stack.pop()
            n = self.active[f.origin] - 1
            if n:
                self.active[f.origin] = n
            else:
                del self.active[f.origin]
        return None

    def line(self, expand: bool = True) -> list[_Tok] | None:
        """The next line; with `expand`, `import` lines are replaced by what they import."""
        while True:
            if self.pending is not None:
                line: list[_Tok] | None = self.pending
                self.pending = None
            else:
                line = self._raw_line()
            if line is None or not expand or line[0].text != "import" or line[0].quoted:
                return line
            self._import(line)

    def unread(self, line: list[_Tok]) -> None:
        self.pending = line

    def _push(self, toks: list[_Tok], origin: str, at: _Tok, what: str) -> None:
        if origin in self.active:
            raise CorefileError(at.where, f"import cycle: {what} imports itself")
        self.stack.append(_Frame(toks, origin))
        self.active[origin] = self.active.get(origin, 0) + 1

    def _import(self, line: list[_Tok]) -> None:
        at = line[0]
        if len(line) != 2:
            raise CorefileError(at.where, f"import takes exactly one argument (a snippet name, a file or a glob), got {len(line) - 1}")
        pattern = replace_env(line[1].text, self.env)
        if not pattern:
            raise CorefileError(at.where, "import requires a non-empty file path or snippet name")
        self.imports += 1
        if self.imports > MAX_IMPORTS:
            raise CorefileError(at.where, f"more than {MAX_IMPORTS} imports (a snippet imported exponentially?)")
        if pattern in self.snippets:
            self._push(self.snippets[pattern], "snippet " + pattern, at, f"snippet {pattern!r}")
            return
        base = self.dirs.get(at.file, ".")
        path = pattern if os.path.isabs(pattern) else os.path.join(base, pattern)
        # caddy checks the joined path; only the pattern is checked here, so a directory
        # named with brackets or stars (a test's tmp dir, say) is read as it is spelled
        if pattern.count("*") > 1 or pattern.count("?") > 1 or ("[" in pattern and "]" in pattern):
            # caddy refuses these: a pattern with many expansions can take very long (caddy#2096)
            raise CorefileError(at.where, f"import glob pattern may only contain one wildcard (*): {pattern}")
        if any(c in pattern for c in "*?["):
            where = pattern if os.path.isabs(pattern) else os.path.join(glob.escape(base), pattern)
            # Go's filepath.Glob matches names starting with a dot too
            matches = sorted(glob.glob(where, include_hidden=True))
            if not matches:
                log.warning("%s: no files matching import glob pattern: %s", at.where, pattern)
                return
        else:
            if not os.path.lexists(path):
                raise CorefileError(at.where, f"file to import not found: {pattern}")
            matches = [path]
        frames: list[tuple[list[_Tok], str, str]] = []
        for m in matches:
            name = os.path.normpath(m)
            if name in self.files:          # imported before in this parse: read it once
                frames.append((*self.files[name], name))
                continue
            try:
                with open(name, encoding="utf-8") as fh:
                    st = os.fstat(fh.fileno())
                    text = fh.read()
            except IsADirectoryError:
                raise CorefileError(at.where, f"could not import {name}: is a directory") from None
            except (OSError, UnicodeDecodeError) as e:
                raise CorefileError(at.where, f"could not import {name}: {getattr(e, 'strerror', None) or e}") from None
            self.dirs.setdefault(name, os.path.dirname(name) or ".")
            self.files[name] = (tokenize(text, name), _identity(name, st))
            frames.append((*self.files[name], name))
        # the first match is read first: push in reverse
        for toks, origin, name in reversed(frames):
            if origin in self.active:
                raise CorefileError(at.where, f"import cycle: {name} imports itself")
        for toks, origin, name in reversed(frames):
            self._push(toks, origin, at, name)


def _identity(path: str, st: os.stat_result | None = None) -> str:
    """What makes two paths the same file for the cycle check (symlinks, as in a mounted
    ConfigMap, and relative spellings included)."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError:
            return "file " + os.path.abspath(path)
    return f"file {st.st_dev}:{st.st_ino}"


def _text(t: _Tok, env: Mapping[str, str]) -> Token:
    return Token(replace_env(t.text, env), t.file, t.line, t.quoted)


class _Parser:
    def __init__(self, reader: _Reader, env: Mapping[str, str]) -> None:
        self.r = reader
        self.env = env
        self.depth = 0

    def _check_braces(self, toks: list[_Tok]) -> None:
        """No brace may stand among a line's tokens (its last `{` already taken off)."""
        for t in toks:
            if t.is_brace("{"):
                raise CorefileError(t.where, "a block's '{' must end its line")
            if t.is_brace("}"):
                raise CorefileError(t.where, "unexpected '}': a block's '}' must be on a line of its own")

    def _opens(self, line: list[_Tok]) -> bool:
        """Does this line open a block: with a last `{`, or a next line that is a lone `{`."""
        if line[-1].is_brace("{"):
            return True
        nxt = self.r.line()
        if nxt is not None and len(nxt) == 1 and nxt[0].is_brace("{"):
            return True
        if nxt is not None:
            self.r.unread(nxt)
        return False

    def body(self, opener: _Tok, what: str) -> list[Directive]:
        """Directive lines up to the `}` that closes `opener`."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CorefileError(opener.where, f"blocks nested deeper than {MAX_DEPTH}")
        out: list[Directive] = []
        while True:
            line = self.r.line()
            if line is None:
                raise CorefileError(opener.where, f"unclosed '{{' of {what}: end of input before its '}}'")
            if line[0].is_brace("}"):
                if len(line) > 1:
                    # `} }` closes two blocks at once; anything else after a '}' is an error
                    if not line[1].is_brace("}"):
                        raise CorefileError(line[1].where, f"unexpected {line[1].text!r} after '}}'")
                    self.r.unread(line[1:])
                self.depth -= 1
                return out
            out.append(self.directive(line))

    def directive(self, line: list[_Tok]) -> Directive:
        name = line[0]
        if name.is_brace("{"):
            raise CorefileError(name.where, "unexpected '{': a block must follow a directive or server block keys")
        opens = self._opens(line)
        explicit = line[-1].is_brace("{")
        toks = line[:-1] if explicit else line
        self._check_braces(toks)
        d = Directive(replace_env(name.text, self.env), [_text(t, self.env) for t in toks[1:]],
                      None, name.file, name.line)
        if opens:
            d.body = self.body(line[-1] if explicit else name, f"'{d.name}'")
        return d

    def blocks(self) -> list[ServerBlock]:
        out: list[ServerBlock] = []
        while True:
            line = self.r.line()
            if line is None:
                return out
            block = self.block(line)
            if block is not None:
                out.append(block)

    def block(self, line: list[_Tok]) -> ServerBlock | None:
        first = line[0]
        if first.is_brace("}"):
            raise CorefileError(first.where, "unexpected '}' (no block is open)")
        keys: list[Token] = []
        while True:
            explicit = line[-1].is_brace("{")
            toks = line[:-1] if explicit else line
            self._check_braces(toks)
            more = False
            for t in toks:
                text = replace_env(t.text, self.env)
                more = text.endswith(",")
                if more:
                    text = text[:-1]
                if text:
                    keys.append(Token(text, t.file, t.line, t.quoted))
            if explicit:
                if more:
                    raise CorefileError(line[-1].where, "expected another server block key before '{' - check for an extra comma")
                opens = True
                break
            if not more:
                opens = self._opens(line)
                break
            nxt = self.r.line()         # a trailing comma: the keys go on on the next line
            if nxt is None:
                raise CorefileError(toks[-1].where, "expected another server block key after ',' but the input ended")
            line = nxt
        where = keys[0] if keys else first
        if not keys:
            if not opens and self.r.line() is None:
                return None             # a line of empty keys ("") alone: nothing, as caddy
            raise CorefileError(first.where, "a server block needs at least one key (zone) before its '{'")
        if len(keys) == 1 and keys[0].text.startswith("(") and keys[0].text.endswith(")"):
            self.snippet(keys[0], opens)
            return None
        if not opens:
            for k in keys:
                if k.text.endswith("{"):
                    raise CorefileError(k.where, f"{k.text!r}: put a space before '{{' to open the server block")
            # a Corefile of one block may leave out its braces: everything up to the end is its body
            directives: list[Directive] = []
            while (l := self.r.line()) is not None:
                if l[0].is_brace("}"):
                    raise CorefileError(l[0].where, "unexpected '}' (the server block has no '{')")
                directives.append(self.directive(l))
            return ServerBlock(keys, directives, where.file, where.line)
        return ServerBlock(keys, self.body(line[-1] if line[-1].is_brace("{") else first,
                                          "server block " + " ".join(k.text for k in keys)),
                           where.file, where.line)

    def snippet(self, key: Token, opens: bool) -> None:
        name = key.text[1:-1]
        if not opens:
            raise CorefileError(key.where, f"snippet {key.text} needs a '{{' block")
        if name in self.r.snippets:
            raise CorefileError(key.where, f"redeclaration of previously declared snippet {name}")
        toks: list[_Tok] = []
        depth = 1
        while True:
            line = self.r.line(expand=False)     # imports in a snippet expand where it is used
            if line is None:
                raise CorefileError(key.where, f"unclosed '{{' of snippet {key.text}")
            for i, t in enumerate(line):
                if t.is_brace("{"):
                    depth += 1
                elif t.is_brace("}"):
                    depth -= 1
                    if depth == 0:
                        if i + 1 < len(line):
                            self.r.unread(line[i + 1:])
                        self.r.snippets[name] = toks
                        return
                toks.append(t)


def parse_text(text: str, filename: str = "Corefile", env: Mapping[str, str] | None = None,
               base_dir: str = ".") -> list[ServerBlock]:
    """The server blocks of a Corefile's text. Relative imports are read from `base_dir`
    (those inside an imported file from that file's directory, as caddy does)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    own = filename if os.path.isabs(filename) else os.path.join(base_dir, os.path.basename(filename))
    reader = _Reader(tokenize(text, filename), _identity(own), {filename: base_dir}, environ)
    return _Parser(reader, environ).blocks()


def load(path: str, env: Mapping[str, str] | None = None) -> list[ServerBlock]:
    """The server blocks of the Corefile at `path`."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CorefileError(path, f"cannot read the Corefile: {getattr(e, 'strerror', None) or e}") from None
    return parse_text(text, filename=path, env=env, base_dir=os.path.dirname(path) or ".")


def walk(directives: Iterable[Directive]) -> Iterable[Directive]:
    """Every directive and, depth first, every line of its body."""
    for d in directives:
        yield d
        if d.body:
            yield from walk(d.body)
