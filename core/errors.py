"""The user-facing errors: each message is ONE line naming the offending values and the way out.

``training.run.run_and_report`` turns any of ``USER_ERRORS`` into ``error: <line>`` on stderr, a failed
``summary.json`` (``stopped`` for ``Stopped``) and exit code 1 (no traceback).
"""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """Bad user input; the message is one line naming the offending values and the fix."""


class DataError(RuntimeError):
    """The dataset cannot be found or read; the message is one line that says the way out."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message is one line."""


class Stopped(TrainingError):
    """The run stopped on a signal after saving a checkpoint (``summary.json`` status ``stopped``); the message is
    one line saying where the checkpoint is."""


USER_ERRORS = (ConfigError, DataError, TrainingError)


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of ``str(error)`` (its type name when the message is empty), cut at ``limit`` characters:
    a library's multi-line message reduced to what fits in a one-line error."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def error_text(error: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of ``error`` (``first_line``), or the type name alone when the message is empty: how a
    one-line message quotes an error it reports, e.g. ``PermissionError: [Errno 1] Operation not permitted: 'x'``."""
    name = type(error).__name__
    return f"{name}: {first_line(error, limit)}" if str(error).strip() else name


# Characters Hydra's override grammar reads as syntax (or cannot lex) in an unquoted value: a path holding one
# must be quoted inside the shell's quotes ('key="a b"'; a quoted '~/x' is expanded by the run, as the shell would).
NEEDS_QUOTES = re.compile(r"[\s()\[\]{}=,'\"#%:$\\~]|[^\x00-\x7f]")


def override(key: str, value: object) -> str:
    """``key=value`` as a command line takes it, for advice a user pastes: a value holding a space or another
    character of Hydra's override grammar (a non-ASCII letter too) quoted for Hydra inside the shell's quotes,
    ``'key="value"'`` (Hydra's override grammar: hydra.cc/docs/advanced/override_grammar/basic)."""
    text = str(value)
    return f"'{key}=\"{text}\"'" if NEEDS_QUOTES.search(text) and '"' not in text else f"{key}={text}"
