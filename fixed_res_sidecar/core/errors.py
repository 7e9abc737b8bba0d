"""Exception text for audit details and verifier messages."""

import re

_MEMORY_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def describe_exception(exc: BaseException, max_chars: int | None = None) -> str:
    """`Type: text` of an exception, memory addresses removed so reruns give identical text.

    With `max_chars`, only the first line of the text, cut to that many characters in all
    (for one-line messages); without, the whole text (for `error_detail`).
    """
    text = _MEMORY_ADDRESS.sub("", str(exc))
    if max_chars is not None:
        text = text.strip().splitlines()[0] if text.strip() else ""
    described = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return described if max_chars is None else described[:max_chars]
