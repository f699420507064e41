"""Shared validators: a schema found valid once is known by its content (agents send the same
tool schemas every turn); an invalid one is refused every time."""

from __future__ import annotations

import jsonschema
import pytest

from mlx_kvserver.api import validate
from mlx_kvserver.errors import RequestError


def test_a_valid_schema_is_checked_once_and_an_invalid_one_always(monkeypatch):
    calls = []
    real = jsonschema.Draft202012Validator.check_schema
    monkeypatch.setattr(jsonschema.Draft202012Validator, "check_schema",
                        lambda s: (calls.append(1), real(s)))
    good = {"type": "object", "properties": {"path": {"type": "string"}, "n": {"minimum": 1}}}
    for _ in range(3):
        validate.tool("read_file", "Read.", dict(good), None, "tools[0]")
    same_reordered = {"properties": {"n": {"minimum": 1}, "path": {"type": "string"}},
                      "type": "object"}
    validate.tool("read_file", "Read.", same_reordered, None, "tools[0]")
    assert len(calls) == 1
    bad = {"type": "objekt"}
    for _ in range(2):
        with pytest.raises(RequestError, match="not valid JSON Schema"):
            validate.tool("f", "", bad, None, "tools[0]")
    assert len(calls) == 3
