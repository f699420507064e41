"""closed_schema.closed: the schema a forced call's grammar is built from allows only declared
keys where the client's schema says nothing of undeclared ones, and nowhere that closing would
refuse what the schema allows (combined schemas, required names it does not declare)."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from mlx_kvserver.chat.closed_schema import closed

F = False  # additionalProperties: false, as closed() adds it


def test_objects_that_declare_properties_are_closed_at_every_depth():
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string"},
        "opts": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "list": {"type": "array", "items": {"properties": {"y": {}}}},
        "pair": {"type": "array", "prefixItems": [{"properties": {"p": {}}}]},
        "free": {"type": "object"},  # no properties declared: a free-form object stays open
        "map": {"type": "object", "additionalProperties": {"properties": {"v": {}}}}},
        "$defs": {"D": {"properties": {"d": {}}}}}
    before = copy.deepcopy(schema)
    out = closed(schema)
    assert schema == before  # the client's schema (the prompt shows it) is not touched
    p = out["properties"]
    assert out["additionalProperties"] is F and p["opts"]["additionalProperties"] is F
    assert p["list"]["items"]["additionalProperties"] is F
    assert p["pair"]["prefixItems"][0]["additionalProperties"] is F
    assert "additionalProperties" not in p["free"]
    assert p["map"]["additionalProperties"]["additionalProperties"] is F
    assert out["$defs"]["D"]["additionalProperties"] is F
    # what it refuses: the keys a small model copies from the schema into its call
    v = jsonschema.Draft202012Validator(out)
    assert v.is_valid({"a": "x", "opts": {"x": 1}, "free": {"anything": 1}})
    assert not v.is_valid({"a": "x", "description": "The city", "type": "string"})
    assert not v.is_valid({"a": "x", "opts": {"x": 1, "required": ["x"]}})


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}},
     "additionalProperties": True},
    # required names it does not declare: closing would make every call invalid
    {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},
    # combined with another schema: closing one part refuses what the other declares
    {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
    {"properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]},
    {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}, {"required": ["a"]}]},
    {"properties": {"a": {}}, "$ref": "#/$defs/B", "$defs": {"B": {"properties": {"b": {}}}}},
    {"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {}}}],
     "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"properties": {"a": {}}}}},
    {"properties": {"a": {}}, "if": {"properties": {"a": {"const": 1}}},
     "then": {"properties": {"b": {}}}},
    {"not": {"properties": {"a": {}}}},
    {"type": "string", "properties": {"a": {}}},
])
def test_left_open_where_closing_could_refuse_what_the_schema_allows(schema):
    assert closed(schema) == schema  # nothing closed, at any depth


def test_alternatives_of_a_bare_anyof_are_closed_one_by_one():
    schema = {"anyOf": [{"properties": {"a": {}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {}}, "required": ["b"]}]}
    out = closed(schema)
    assert [alt["additionalProperties"] for alt in out["anyOf"]] == [F, F]
    v = jsonschema.Draft202012Validator(out)
    assert v.is_valid({"a": 1}) and v.is_valid({"b": 1}) and not v.is_valid({"a": 1, "c": 2})


def test_a_def_used_both_alone_and_combined_stays_open():
    schema = {"$defs": {"P": {"properties": {"x": {}}}, "Q": {"properties": {"y": {}}}},
              "properties": {"alone": {"$ref": "#/$defs/Q"},
                             "both": {"allOf": [{"$ref": "#/$defs/P"}, {"$ref": "#/$defs/Q"}]},
                             "again": {"$ref": "#/$defs/P"}}}
    out = closed(schema)
    assert "additionalProperties" not in out["$defs"]["P"]  # combined in "both"
    assert "additionalProperties" not in out["$defs"]["Q"]
    assert out["additionalProperties"] is F
    v = jsonschema.Draft202012Validator(out)
    assert v.is_valid({"both": {"x": 1, "y": 2}})


def test_names_that_need_escaping_in_a_pointer():
    schema = {"$defs": {"a/b~c": {"properties": {"x": {}}}},
              "properties": {"k": {"allOf": [{"$ref": "#/$defs/a~1b~0c"}, {"required": ["x"]}]}}}
    out = closed(schema)
    assert "additionalProperties" not in out["$defs"]["a/b~c"]


def test_not_a_schema_object_is_returned_as_it_is():
    assert closed(True) is True and closed(None) is None
