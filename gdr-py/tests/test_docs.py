"""docs/python.md names only what the package has: every call of a gdr
object it shows (the first column of its name-for-name table, and its code
blocks but the NIXL and Mooncake ones) names a method that exists, with
keywords that method takes; and what it says of messages holds."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Iterator

import pytest

import gdr

from conftest import WAIT

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"

# The names the doc gives gdr's objects.
CLASSES = {
    "gdr": gdr,
    "engine": gdr.Engine,
    "region": gdr.Region,
    "peer": gdr.Peer,
    "grant": gdr.Grant,
    "batch": gdr.Batch,
    "listener": gdr.Listener,
    "stream": gdr.Stream,
    "gdr.Descriptor": gdr.Descriptor,
    "grant.descriptor": gdr.Descriptor,
}


def _gdr_text() -> Iterator[str]:
    """The doc's text about gdr's API: the first cell of each table row,
    and each code block not labelled NIXL or Mooncake."""
    text = DOC.read_text()
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            yield line.split(" | ")[0].lstrip("| ")
    label = ""
    for part in re.split(r"(^```[a-z]*\n.*?^```$)", text, flags=re.S | re.M):
        if part.startswith("```"):
            if "NIXL" not in label and "Mooncake" not in label:
                yield part
        else:
            labels = re.findall(r"^\*\*(\w+)\*\*", part, flags=re.M)
            label = labels[-1] if labels else ""


def _calls(text: str) -> Iterator[tuple[str, str, str]]:
    """``(object, method, arguments)`` of each ``object.method(...)`` call
    of a gdr object in ``text`` (arguments across lines, nested brackets
    kept)."""
    names = "|".join(re.escape(n) for n in sorted(CLASSES, key=len, reverse=True))
    for found in re.finditer(rf"(?<![\w.])({names})\.(\w+)\(", text):
        depth, end = 1, found.end()
        while depth and end < len(text):
            depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(text[end], 0)
            end += 1
        yield found.group(1), found.group(2), text[found.end() : end - 1]


def _parameters(owner: object, method: str) -> list[str]:
    function = getattr(owner, method)
    if inspect.isclass(function):
        function = function.__init__
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a native method without text_signature
        return []
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        # Engine(**config): the native constructor names them.
        signature = inspect.signature(gdr._gdr.Engine)
    return [name for name in signature.parameters if name != "self"]


def test_every_call_the_doc_shows_exists_with_its_keywords() -> None:
    checked = 0
    for text in _gdr_text():
        for obj, method, arguments in _calls(text):
            owner = CLASSES[obj]
            assert hasattr(owner, method), f"docs/python.md: {obj}.{method} does not exist"
            parameters = _parameters(owner, method)
            for keyword in re.findall(r"(?<![\w=])(\w+)=(?!=)", arguments):
                assert keyword in parameters, f"docs/python.md: {obj}.{method}() takes no {keyword}= ({parameters})"
                checked += 1
            # A name that reads as a parameter (an offset, a length) is one.
            for name in re.findall(r"\b(\w*(?:offset|length)\w*)\b(?!=)", arguments):
                assert name in parameters, f"docs/python.md: {obj}.{method}() has no parameter {name} ({parameters})"
    assert checked >= 5, "the doc's keywords were not found"


def test_the_message_payload_the_doc_names(pair) -> None:
    assert "4,088 bytes" in DOC.read_text()
    pair.to_server.send(bytes(4088)).wait(WAIT)
    assert len(pair.to_client.recv(WAIT)) == 4088
    with pytest.raises(gdr.InvalidArgument, match="exceeds"):
        pair.to_server.send(bytes(4089)).wait(WAIT)
