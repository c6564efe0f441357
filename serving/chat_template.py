"""`--chat-template` (vLLM's flag): a Jinja chat template that replaces the model's in the router, given as a
file or as the template text itself. Read and compiled where the flag is parsed: a bad one stops `pdserve
router` at start-up, and `up` and `serve` before they start any process."""

from __future__ import annotations

import errno
from pathlib import Path

CHAT_TEMPLATE_HELP = (
    "a Jinja chat template (a file, or the template text itself) that replaces the model's, as vLLM's "
    "--chat-template"
)
_NO_FILE = (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG)


def read_chat_template(value: str) -> tuple[str, Path | None]:
    """The template's text, and the file it was read from (None: `value` is the text itself, which it may
    be only where no file has that name and it reads as a template, with "{{" or "{%"); ValueError naming
    the flag for a file that cannot be read, a name that is neither, or a template that does not parse."""
    from engine.tokenizer import compile_chat_template  # not at import: the CLI imports no tokenizer

    path = Path(value)
    try:
        text, file = path.read_text(encoding="utf-8"), path.resolve()
    except OSError as e:
        if e.errno not in _NO_FILE:
            raise ValueError(f"--chat-template: cannot read {value}: {e.strerror}") from None
        if "{{" not in value and "{%" not in value:
            raise ValueError(f"--chat-template: no such file: {value}") from None
        text, file = value, None
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-template: {value} is not UTF-8 text: {e}") from None
    try:
        compile_chat_template(text)
    except ValueError as e:
        raise ValueError(f"--chat-template: {e}") from None
    return text, file


def chat_template_argv(value: str | None) -> list[str]:
    """The router child's --chat-template, checked here first: a file by its absolute path, else the text."""
    if value is None:
        return []
    text, file = read_chat_template(value)
    return [f"--chat-template={file or text}"]
