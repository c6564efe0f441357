"""The list parsers: `mistral` (content, then `[TOOL_CALLS]` and a JSON array of calls) and `pythonic` (a Python list
of calls, Llama 3.2's and 4's). Each call goes out as soon as its element of the list is complete; where the list
stops being calls, the calls already sent stand and the text after them is content.
"""

from __future__ import annotations

import ast
import json

from gateway.call_stream import JSON_SPACE, CallStream, Delta, held_prefix

MISTRAL_TAG = "[TOOL_CALLS]"


class _Brackets:
    """How deep in brackets a JSON or Python text is as it streams in, skipping strings (with escapes; Python's
    single, double and triple quoted ones) and Python's comments: `step` takes a character, says if it is code."""

    def __init__(self, python: bool) -> None:
        self.python = python
        self.opens, self.closes = ("([{", ")]}") if python else ("[{", "]}")
        self.depth = 0
        self.quote = ""  # the open string's closing quote, "" outside strings
        self.quotes = 0  # quote characters in a row: whether Python's '' is an empty string or opens '''
        self.opening = self.escaped = self.comment = False

    def step(self, ch: str) -> bool:
        """Takes one character; True where it is code (outside strings and comments), brackets counted."""
        if self.comment:
            self.comment = ch != "\n"
            return False
        if self.quote and self._string(ch):
            return False
        if ch == '"' or (self.python and ch == "'"):
            self.quote, self.opening, self.quotes = ch, self.python, int(self.python)
            return False
        if self.python and ch == "#":
            self.comment = True
            return False
        if ch in self.opens:
            self.depth += 1
        elif ch in self.closes and self.depth:
            self.depth -= 1
        return True

    def _string(self, ch: str) -> bool:
        """Takes a character after a string opened; False where the string ended before it (Python's '')."""
        if self.opening:
            if ch == self.quote:
                self.quotes += 1
                if self.quotes == 3:
                    self.quote, self.quotes, self.opening = ch * 3, 0, False
                return True
            self.opening = False
            if self.quotes == 2:
                self.quote, self.quotes = "", 0
                return False
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == self.quote[0]:
            self.quotes += 1
            if self.quotes == len(self.quote):
                self.quote = ""
            else:
                return True
        self.quotes = 0
        return True


class _ListCalls(CallStream):
    """A list read a character at a time (`_read`: the call of the element a character ends, if any)."""

    def _read(self, ch: str) -> dict | None:
        raise NotImplementedError

    def _calls(self, text: str) -> list[dict]:
        return [call for call in map(self._read, text) if call is not None]


class MistralCalls(_ListCalls):
    """`mistral`: content, then `[TOOL_CALLS]` and a JSON array of {"name", "arguments"} objects (Mistral's
    v0.3 format). The content streams, and each element goes out as a call once its object closes. An array
    that does not parse as calls is content, as written, tag and all; where calls went out before that showed,
    the text after the last of them is."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # content held back: a possible tag's start
        self.after: list[str] | None = None  # the text after the tag
        self.brackets = _Brackets(python=False)
        self.rest: list[str] = []  # the text after the tag since the last call's element
        self.start = 0  # where in `rest` the element being read starts
        self.broken = False  # the text has stopped being an array of calls: no more go out

    def feed(self, text: str) -> Delta:
        out = Delta()
        if self.after is None:
            self.pending += text
            at = self.pending.find(MISTRAL_TAG)
            if at < 0:
                keep = held_prefix(self.pending, MISTRAL_TAG)
                out.content = self._content(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return out
            out.content = self._content(self.pending[:at])
            text, self.pending, self.after = self.pending[at + len(MISTRAL_TAG) :], "", []
        self.after.append(text)
        out.calls += self._calls(text)
        return out

    def _read(self, ch: str) -> dict | None:
        """Reads one character of the array: the call of the element it closes, if any."""
        self.rest.append(ch)
        depth = self.brackets.depth
        if self.broken or not self.brackets.step(ch):
            return None
        if depth == 1 and self.brackets.depth == 2:
            self.start = len(self.rest) - 1
        if depth != 2 or self.brackets.depth != 1:
            return None
        call = None
        if "".join(self.rest[: self.start]).strip(JSON_SPACE) == ("," if self.called else "["):
            call = self._parsed("".join(self.rest[self.start :]), ("arguments", "parameters"))
        self.broken = call is None
        if call is not None:
            self.rest = []
        return call

    def finish(self) -> Delta:
        space, self.space = self.space, ""
        if self.after is None:
            rest, self.pending = self.pending, ""
            return Delta(content=(space + rest) if rest.strip() or not self.called else "")
        text = "".join(self.after)
        try:
            found = json.loads(text)
        except (ValueError, RecursionError):
            found = None
        items = found if isinstance(found, list) and found else None
        if items is None or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
            return Delta(content="".join(self.rest) if self.called else space + MISTRAL_TAG + text)
        # each element went out as it closed; the rest is a safeguard that keeps the whole array's calls
        calls = [self._parsed(json.dumps(c), ("arguments", "parameters")) for c in items[self.called :]]
        return Delta(calls=[c for c in calls if c is not None])


class PythonicCalls(_ListCalls):
    """`pythonic` (Llama 3.2 and 4): a text that is a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), get_time()]`; any other text is content. Each element goes out as a call once
    the "," or "]" after it comes (a call's text may go on: `f(x=1)(y=2)`). A list that does not parse as calls
    is content, as written; where calls went out before that showed, the text after the last of them is."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.started = self.plain = False
        self.brackets = _Brackets(python=True)
        self.rest: list[str] = []  # the text since the last call's element
        self.start = 0  # where in `rest` the element being read starts
        self.done = False  # the list has closed or stopped being one of calls: no more calls go out

    def feed(self, text: str) -> Delta:
        if self.plain:
            return Delta(content=text)
        self.text.append(text)
        if not self.started:
            lead = "".join(self.text).lstrip()
            if lead and not lead.startswith("["):
                self.plain = True
                held, self.text = "".join(self.text), []
                return Delta(content=held)
            self.started = bool(lead)
            text = "".join(self.text) if lead else ""
        return Delta(calls=self._calls(text))

    def _read(self, ch: str) -> dict | None:
        """Reads one character of the list: the call of the element it ends, if any."""
        self.rest.append(ch)
        depth = self.brackets.depth
        if self.done or not self.brackets.step(ch):
            return None
        if depth == 0:  # the list's "[", or whitespace before it
            self.start = len(self.rest)
            return None
        ends = depth == 1 and self.brackets.depth == 0
        if not (ends or (depth == 1 and ch == ",")):
            return None
        found = _python_calls("[" + "".join(self.rest[self.start : -1]) + "]") if ch in ",]" else None
        one = found[0] if found is not None and len(found) == 1 else None
        self.done = one is None or ends
        if one is None:
            return None
        self.rest, self.start = [ch], 1
        return self._call(one[0], json.dumps(one[1], ensure_ascii=False))

    def finish(self) -> Delta:
        if self.plain:
            return Delta()
        text, self.text = "".join(self.text), []
        calls = _python_calls(text.strip())
        if calls is None:
            return Delta(content="".join(self.rest) if self.called else text)
        # each element went out as it ended; the rest is a safeguard that keeps the whole list's calls
        rest = calls[self.called :]
        return Delta(calls=[self._call(name, json.dumps(args, ensure_ascii=False)) for name, args in rest])


def _python_calls(text: str) -> list[tuple[str, dict]] | None:
    """[(name, keyword arguments)] of a Python list of calls whose arguments are literals, or None."""
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        out = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
                return None
            if any(k.arg is None for k in call.keywords):  # **kwargs
                return None
            out.append((call.func.id, {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}))
        json.dumps(out)  # literals JSON cannot carry (sets, bytes, complex) are no call
        return out
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
