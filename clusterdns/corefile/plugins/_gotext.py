"""The part of Go's text/template that CoreDNS's template plugin documents and its users
write, compiled at setup and rendered per query:

    {{ .Name }}  {{ .Zone }}  {{ .Class }}  {{ .Type }}  {{ .Remote }}  {{ .Regex }}
    {{ .Group.b }}  {{ index .Match 1 }}  {{ index .Group "b" }}  {{ .Question.Name }}
    {{ parseInt .Group.b 16 8 }}  {{ parseInt (index .Match 1) 16 8 }}
    {{ .Meta "kubernetes/client-namespace" }}   (always "": clusterdns has no metadata plugin,
                                                 which is what CoreDNS answers without one)
    {{/* comments */}}  {{- trim markers -}}  pipelines (`1 | index .Match` passes 1 last)

Anything else Go would accept (if/range/with, variables, printf and the other builtins,
.Message, .Question as a whole) is refused at setup with TemplateError, never rendered
differently. What Go only finds while executing stays an execution error here too (an
index out of range, a field the data does not have such as `.Grup`): the query gets
SERVFAIL and the reason is logged, as in CoreDNS.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping


class TemplateError(ValueError):
    """The template cannot be compiled (setup) or executed (one query)."""


class _NoValue:
    def __str__(self) -> str:
        return "<no value>"


NO_VALUE = _NoValue()

# The fields CoreDNS's templateData has (plugin/template/template.go).
FIELDS = {"Zone", "Name", "Regex", "Match", "Group", "Class", "Type", "Message", "Question", "Remote", "Meta"}
QUESTION_FIELDS = {"Name", "Qtype", "Qclass"}
FUNCTIONS = {"index", "parseInt"}
GO_BUILTINS = {"and", "or", "not", "len", "slice", "print", "printf", "println", "eq", "ne", "lt", "le",
               "gt", "ge", "html", "js", "urlquery", "call"}
KEYWORDS = {"if", "else", "end", "range", "with", "define", "template", "block", "break", "continue",
            "nil", "true", "false"}


@dataclass(frozen=True)
class Field:
    path: tuple[str, ...]

    def __str__(self) -> str:
        return "." + ".".join(self.path)


@dataclass(frozen=True)
class Const:
    value: Any
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Func:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Pipe:
    commands: tuple[tuple[Any, ...], ...]   # each a tuple of nodes (Field, Const, Func, Pipe)

    def __str__(self) -> str:
        return " | ".join(" ".join(_show(n) for n in c) for c in self.commands)


def _show(node: Any) -> str:
    return f"({node})" if isinstance(node, Pipe) else str(node)


_ACTION_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\\n]|\\.)*')
  | (?P<num>[-+]?(?:0[xXoObB][0-9a-fA-F_]+|[0-9][0-9_]*)(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<var>\$[A-Za-z0-9_]*)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>:=|=|\||\(|\)|,)
""", re.VERBOSE)


def _lex(text: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(text):
        m = _ACTION_TOKEN.match(text, i)
        if m is None:
            raise TemplateError(f"unexpected {text[i]!r} in action")
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append((kind, m.group()))
        i = m.end()
    return out


class _Parser:
    def __init__(self, toks: list[tuple[str, str]]) -> None:
        self.toks, self.i = toks, 0

    def pipeline(self, closing: str | None) -> Pipe:
        commands: list[tuple[Any, ...]] = []
        current: list[Any] = []
        while True:
            if self.i >= len(self.toks):
                if closing:
                    raise TemplateError("unclosed left paren")
                break
            kind, text = self.toks[self.i]
            self.i += 1
            if kind == "punct" and text == ")":
                if closing != ")":
                    raise TemplateError("unexpected right paren")
                break
            if kind == "punct" and text == "|":
                if not current:
                    raise TemplateError("missing command before '|'")
                commands.append(tuple(current))
                current = []
                continue
            current.append(self.operand(kind, text))
        if not current:
            raise TemplateError("missing value for command" if commands else "empty command")
        commands.append(tuple(current))
        return Pipe(tuple(commands))

    def operand(self, kind: str, text: str) -> Any:
        if kind == "punct" and text == "(":
            return self.pipeline(")")
        if kind == "field":
            if text == ".":
                raise TemplateError("'{{ . }}' (the whole data) is not supported")
            return Field(tuple(text[1:].split(".")))
        if kind == "str":
            try:
                return Const(ast.literal_eval(text), text)
            except (ValueError, SyntaxError):
                raise TemplateError(f"bad string {text}") from None
        if kind == "raw":
            return Const(text[1:-1], text)
        if kind == "num":
            t = text.replace("_", "")
            try:
                return Const(int(t, 0) if not re.fullmatch(r"[-+]?0[0-7]+", t) else int(t, 8), text)
            except ValueError:
                raise TemplateError(f"number {text} is not supported (integers only)") from None
        if kind == "ident":
            if text in KEYWORDS:
                raise TemplateError(f"'{text}' is not supported")
            if text in GO_BUILTINS:
                raise TemplateError(f"function {text!r} is not supported (only index and parseInt)")
            if text not in FUNCTIONS:
                raise TemplateError(f'function "{text}" not defined')
            return Func(text)
        if kind == "var":
            raise TemplateError(f"variables ({text}) are not supported")
        if kind == "char":
            raise TemplateError(f"character constants ({text}) are not supported")
        raise TemplateError(f"unexpected {text!r} in action")


def _check(pipe: Pipe) -> None:
    """Refuse at setup what this renderer would not execute as Go does."""
    for c, command in enumerate(pipe.commands):
        head = command[0]
        if isinstance(head, Func):
            got = len(command) - 1 + (1 if c else 0)     # a piped value is the last argument
            if head.name == "parseInt" and got != 3:
                raise TemplateError(f"wrong number of args for parseInt: want 3 got {got}")
            if head.name == "index" and got < 1:
                raise TemplateError("wrong number of args for index: want at least 1 got 0")
        for n, node in enumerate(command):
            if isinstance(node, Pipe):
                _check(node)
            elif isinstance(node, Func) and n > 0:
                raise TemplateError(f"function {node.name} used as an argument (wrap it in parentheses)")
            elif isinstance(node, Field):
                head = node.path[0]
                if head == "Message":
                    raise TemplateError(".Message is not supported (use .Name, .Type, .Class, .Question.Name)")
                if head == "Question" and (len(node.path) != 2 or node.path[1] not in QUESTION_FIELDS):
                    raise TemplateError(f"{node} is not supported (.Question.Name, .Question.Qtype, "
                                        ".Question.Qclass are)")
                if head == "Meta" and (n != 0 or len(command) != 2 or len(node.path) != 1):
                    raise TemplateError(".Meta takes one metadata name: {{ .Meta \"NAME\" }}")
                if head in FIELDS and head != "Meta" and len(command) > 1 and n == 0:
                    raise TemplateError(f"{node} is not a function: it takes no arguments")


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Action:
    pipe: Pipe
    source: str


class Template:
    """A compiled template: `render(data)` -> str, raising TemplateError on execution errors."""

    def __init__(self, name: str, source: str) -> None:
        self.name, self.source = name, source
        self.parts: list[Text | Action] = []
        text, i = source, 0
        pending = ""
        while True:
            j = text.find("{{", i)
            if j < 0:
                pending += text[i:]
                break
            pending += text[i:j]
            k = j + 2
            trim_left = text.startswith("- ", k) or text.startswith("-\t", k) or text.startswith("-\n", k)
            if trim_left:
                pending = pending.rstrip(" \t\r\n")
                k += 1
            end = self._close(text, k)
            body = text[k:end]
            trim_right = body.endswith((" -", "\t-", "\n-"))
            if trim_right:
                body = body[:-1]
            i = end + 2
            if trim_right:
                while i < len(text) and text[i] in " \t\r\n":
                    i += 1
            stripped = body.strip()
            if stripped.startswith("/*"):
                if not stripped.endswith("*/"):
                    raise TemplateError(f"template: {name}: unclosed comment")
                continue
            if pending:
                self.parts.append(Text(pending))
                pending = ""
            try:
                pipe = _Parser(_lex(body)).pipeline(None)
                _check(pipe)
            except TemplateError as exc:
                raise TemplateError(f"template: {name}: {{{{{body.strip()}}}}}: {exc}") from None
            self.parts.append(Action(pipe, body.strip()))
        if pending:
            self.parts.append(Text(pending))

    def _close(self, text: str, k: int) -> int:
        """Where the action's `}}` is (not inside a string)."""
        i = k
        while i < len(text):
            c = text[i]
            if c == "}" and text.startswith("}}", i):
                return i
            if c in "\"'`":
                j = i + 1
                while j < len(text) and text[j] != c:
                    if text[j] == "\\" and c != "`":
                        j += 1
                    j += 1
                i = j + 1
                continue
            i += 1
        raise TemplateError(f"template: {self.name}: unclosed action")

    def render(self, data: Mapping[str, Any]) -> str:
        out = []
        for part in self.parts:
            if isinstance(part, Text):
                out.append(part.text)
                continue
            try:
                out.append(_print(_pipe(part.pipe, data)))
            except TemplateError as exc:
                raise TemplateError(f"template: {self.name}: executing at <{part.source}>: {exc}") from None
        return "".join(out)


def _print(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + " ".join(_print(x) for x in v) + "]"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{_print(v[k])}" for k in sorted(v)) + "]"
    return str(v)


def _pipe(pipe: Pipe, data: Mapping[str, Any]) -> Any:
    value: Any = None
    for n, command in enumerate(pipe.commands):
        value = _command(command, data, value, n > 0)
    return value


def _arg(node: Any, data: Mapping[str, Any]) -> Any:
    if isinstance(node, Const):
        return node.value
    if isinstance(node, Pipe):
        return _pipe(node, data)
    return _field(node, data)


def _command(command: tuple[Any, ...], data: Mapping[str, Any], piped: Any, has_pipe: bool) -> Any:
    head = command[0]
    if isinstance(head, Func):
        args = [_arg(a, data) for a in command[1:]]
        if has_pipe:
            args.append(piped)
        return _CALLS[head.name](*args)
    if isinstance(head, Field) and head.path == ("Meta",):
        return ""      # no metadata plugin in clusterdns: CoreDNS's .Meta gives "" then
    if has_pipe or len(command) > 1:
        raise TemplateError(f"can't give argument to non-function {_show(head)}")
    return _arg(head, data)


def _field(node: Field, data: Mapping[str, Any]) -> Any:
    head = node.path[0]
    if head not in data:
        raise TemplateError(f"can't evaluate field {head} in type *template.templateData")
    v = data[head]
    for name in node.path[1:]:
        if isinstance(v, dict):     # .Group.x; a missing key prints "<no value>", as Go's maps
            v = v.get(name, NO_VALUE)
        else:
            raise TemplateError(f"can't evaluate field {name} in type {_go_type(v)}")
    return v


def _go_type(v: Any) -> str:
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "[]string"
    if isinstance(v, int):
        return "int"
    return type(v).__name__


def _index(item: Any, *indices: Any) -> Any:
    v = item
    for i in indices:
        if isinstance(v, list):
            if not isinstance(i, int) or isinstance(i, bool):
                raise TemplateError(f"error calling index: cannot index slice/array with type {_go_type(i)}")
            if i < 0 or i >= len(v):
                raise TemplateError(f"error calling index: index out of range: {i}")
            v = v[i]
        elif isinstance(v, dict):
            if not isinstance(i, str):
                raise TemplateError(f"error calling index: value has type {_go_type(i)}; should be string")
            v = v.get(i, "")   # a missing map key is the element's zero value
        else:
            raise TemplateError(f"error calling index: can't index item of type {_go_type(v)}")
    return v


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _parse_int(s: Any, base: Any, bits: Any) -> int:
    """strconv.ParseUint(s, base, bitSize) (CoreDNS's parseInt)."""
    if not isinstance(s, str) or not isinstance(base, int) or not isinstance(bits, int):
        raise TemplateError("error calling parseInt: wrong argument types (want string, int, int)")
    where = f'strconv.ParseUint: parsing "{s}"'
    if bits == 0:
        bits = 64
    if bits < 0 or bits > 64:
        raise TemplateError(f"error calling parseInt: {where}: invalid bit size {bits}")
    digits = s
    if base == 0:
        base = 10
        lower = s.lower()
        if lower.startswith("0x"):
            base, digits = 16, s[2:]
        elif lower.startswith("0b"):
            base, digits = 2, s[2:]
        elif lower.startswith("0o"):
            base, digits = 8, s[2:]
        elif len(s) > 1 and s[0] == "0":
            base, digits = 8, s[1:]
    elif base < 2 or base > 36:
        raise TemplateError(f"error calling parseInt: {where}: invalid base {base}")
    if not digits or any(c not in _DIGITS[:base] for c in digits.lower()):
        raise TemplateError(f"error calling parseInt: {where}: invalid syntax")
    value = int(digits, base)
    if value >= 1 << bits:
        raise TemplateError(f"error calling parseInt: {where}: value out of range")
    return value


_CALLS: dict[str, Callable[..., Any]] = {"index": _index, "parseInt": _parse_int}
