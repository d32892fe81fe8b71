"""The one exception type that reaches the user as a one-line message instead of a traceback.

Raise UserError for anything the user can fix (a path, a flag, a file's contents); its message names
the problem and the fix. Bugs stay ordinary exceptions so they keep their traceback.
"""


class UserError(Exception):
    """A problem with the user's input or settings; str(error) is the whole message shown."""


def short_reason(error: BaseException) -> str:
    """The first sentence of an exception's message, to quote inside a one-line UserError."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text.split(". ")[0].rstrip(".")
