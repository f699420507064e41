"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=tests.api.schemathesis_hooks``) for
tests/api/test_openapi.py: a body schemathesis generates as valid by the served description is
made to keep the rules the description states in words, because JSON Schema cannot
(``tests/schema_bodies.follow_rules``: tool results answer earlier calls, ids and tool names are
unique, a named tool is one of the tools; and token ids are below the vocabulary size). Nothing
else is changed: any other refusal of such a body is a mismatch schemathesis reports (ST202), and
bodies generated as invalid are sent as they are (ST201 if one is accepted). Only the refusals the
tests never count as being about a body's shape (tests/schema_bodies.not_about_shape: a prompt
longer than the model's context, a body over the size limit) are dropped from ST202.
"""

from __future__ import annotations

import schemathesis

from tests.schema_bodies import follow_rules, not_about_shape

VOCAB = 256  # token ids below every vocabulary served here (the tests' tiny model has 320)


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return
    body = follow_rules(case.path, case.body)
    if case.path in ("/v1/completions", "/v1/completions/render") or \
            case.path == "/tokenize" and body.get("messages") is None:
        body["prompt"] = _below_vocab(body["prompt"])
    if case.path == "/detokenize":
        body["tokens"] = _below_vocab(body["tokens"])
    case.body = body


def _below_vocab(prompt):
    if isinstance(prompt, list):
        return [_below_vocab(p) for p in prompt]
    return prompt % VOCAB if isinstance(prompt, (int, float)) else prompt  # (7.0: an integer)


@schemathesis.hook
def filter_failure(ctx, failure, case, response):
    return not (failure.code == "ST202" and not_about_shape(response))
