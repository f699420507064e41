"""Call readers of the formats whose arguments are parameters as tags (chat/xml_calls.py:
Qwen3-Coder, GLM 4.7, MiniMax M2) typed by the tool's schema, fed character by character; what
they share with Gemma 4's reader (chat/gemma_calls.py) is checked for it too."""

from __future__ import annotations

import pytest

from mlx_kvserver.chat.calls import Args, Dropped, Unparsed
from tests.chat.test_calls import check_streams, stream, summary, whole

QP = "<parameter={}>\n{}\n</parameter>\n"
GP = "<arg_key>{}</arg_key>\n<arg_value>{}</arg_value>\n"
MP = '<parameter name="{}">{}</parameter>\n'
FMT = {  # parser: (call text from its parameters, parameter text)
    "qwen3_coder": (lambda ps: "<function=get_weather>\n" + ps + "</function>\n", QP),
    "glm47": (lambda ps: "get_weather\n" + ps, GP),
    "minimax_m2": (lambda ps: '<invoke name="get_weather">\n' + ps + "</invoke>\n", MP),
}
XML = list(FMT)
CITY_OPEN = {"qwen3_coder": "<parameter=city>", "glm47": "<arg_value>",
             "minimax_m2": '<parameter name="city">'}
VALUE_END = {"qwen3_coder": "</parameter>", "glm47": "</arg_value>", "minimax_m2": "</parameter>"}


def call(parser, *params):
    head, param = FMT[parser]
    return head("".join(param.format(k, v) for k, v in params))


PARIS = ("city", "Paris"), ("days", "3"), ("metric", "true")
ROME = ("city", "Rome"), ("opts", '{"a": [1, "x"]}')
P, R = '{"city": "Paris", "days": 3, "metric": true}', '{"city": "Rome", "opts": {"a": [1, "x"]}}'
GEMMA_P = 'call:get_weather{city:<|"|>Paris<|"|>,days:3,metric:true}'
GEMMA_R = 'call:get_weather{city:<|"|>Rome<|"|>,opts:{a:[1,<|"|>x<|"|>]}}'


@pytest.mark.parametrize("parser", XML)
def test_parameters_stream_as_json(parser):
    several = parser != "glm47"  # GLM's block holds one call
    body = call(parser, *PARIS) + (call(parser, *ROME) if several else "")
    got = check_streams(parser, body, [("get_weather", P)] + ([("get_weather", R)] * several))
    opened = body.index(CITY_OPEN[parser]) + len(CITY_OPEN[parser])
    assert (opened, Args('{"city": "')) in got  # a parameter's head as soon as its tag is read


@pytest.mark.parametrize("parser", XML)
def test_a_typed_value_comes_whole_once_what_follows_its_tag_is_read(parser):
    body = call(parser, *PARIS)
    got = stream(parser, body)
    at = {p.text: i for i, p in got if isinstance(p, Args)}
    tag_end = body.index(VALUE_END[parser], body.index("3")) + len(VALUE_END[parser])
    assert at["3"] > tag_end and at["3"] == at[', "metric": ']  # with the next parameter's head
    assert at["true"] == (len(body) + 1 if parser == "glm47" else at["}"])  # GLM: at the end


@pytest.mark.parametrize("parser, value, expected", [
    ("qwen3_coder", "maybe", "false"), ("minimax_m2", "maybe", '"maybe"'),
    ("glm47", "maybe", '"maybe"'), ("minimax_m2", "yes", "true"), ("qwen3_coder", "null", "null"),
])
def test_boolean_typing_per_format(parser, value, expected):
    ((_, args, _, problem),) = whole(parser, call(parser, ("metric", value)))
    assert (args, problem) == ('{"metric": ' + expected + "}", None)


@pytest.mark.parametrize("parser, expected", [
    ("qwen3_coder", '{"zzz": "3"}'), ("minimax_m2", '{"zzz": "3"}'), ("glm47", '{"zzz": 3}')])
def test_a_parameter_the_schema_lacks(parser, expected):
    """Qwen and MiniMax read it as a string (streamed), GLM types it (JSON, then Python)."""
    assert whole(parser, call(parser, ("zzz", "3"))) == [("get_weather", expected, "", None)]


def test_glm_reads_python_literals():
    assert whole("glm47", call("glm47", ("opts", "{'a': True, 'b': None}")))[0][1] == \
        '{"opts": {"a": true, "b": null}}'


def test_qwen_value_holding_its_own_end_tag():
    """Qwen3-Coder: an end tag ends the value only where a parameter of the schema or the call's
    end follows it (a file being written may hold the tags)."""
    content = "<x></parameter>\n<parameter=zzz>\n</x>\n</parameter></x>"
    body = call("qwen3_coder", ("city", content), ("days", "3"))
    got = stream("qwen3_coder", body)
    assert summary([p for _, p in got]) == [("get_weather", '{"city": "<x></parameter>\\n'
                                             '<parameter=zzz>\\n</x>\\n</parameter></x>", '
                                             '"days": 3}', "", None)]
    # the text before each "</parameter>" inside the value went out before its tag was decided
    assert (body.index("<x>") + 2, Args("<x")) in got
    # MiniMax: the first end tag ends the value; what follows is not a parameter
    m = call("minimax_m2", ("city", "<x></parameter></x>"))
    assert whole("minimax_m2", m) == [("get_weather", '{"city": "<x>"',
                                       m[m.index("</x>"):],
                                       "invalid_markup: text between parameters")]


@pytest.mark.parametrize("parser", XML)
def test_string_values_are_trimmed_per_format(parser):
    body = call(parser, ("city", "  Paris \n"))
    expected = {"qwen3_coder": "  Paris \\n", "glm47": "  Paris \\n", "minimax_m2": "Paris"}
    assert whole(parser, body)[0][1] == '{"city": "' + expected[parser] + '"}'


@pytest.mark.parametrize("parser", [*XML, "gemma4"])
def test_cut_off_inside_the_name_is_dropped(parser):
    body = GEMMA_P if parser == "gemma4" else call(parser, *PARIS)
    for cut in (body.index("get_weather") + 7, body.index("get_weather") + 11):
        assert whole(parser, body[:cut], closed=False) == [Dropped(body[:cut])]


@pytest.mark.parametrize("parser", [*XML, "gemma4"])
def test_cut_off_inside_the_arguments_is_truncated(parser):
    body = GEMMA_P if parser == "gemma4" else call(parser, *PARIS)
    head = '{"city":"' if parser == "gemma4" else '{"city": "'
    assert whole(parser, body[:body.index("Paris") + 3], closed=False) == \
        [("get_weather", head + "Par", "", "truncated")]
    cut = body.index("3") + 1  # a typed value is not passed on until it is complete
    assert whole(parser, body[:cut], closed=False)[0][3] == "truncated"
    assert whole(parser, body[:cut], closed=False)[0][1].endswith(
        '"days":' if parser == "gemma4" else '"days": ')


@pytest.mark.parametrize("parser", ["qwen3_coder", "minimax_m2", "gemma4"])
def test_a_closed_block_with_no_call_goes_back_as_text(parser):
    assert whole(parser, "hello there") == [Unparsed("hello there")]
    assert whole(parser, "  \n") == []


def test_glm_reads_a_bare_line_as_a_call_without_arguments():
    assert whole("glm47", "get_weather") == [("get_weather", "{}", "", None)]
    assert whole("glm47", "hello there") == [("hello there", "{}", "", None)]


@pytest.mark.parametrize("parser", ["glm47", "minimax_m2"])
def test_text_between_parameters_is_invalid_markup(parser):
    body = call(parser, ("city", "Paris"), ("days", "3"))
    body = body.replace(VALUE_END[parser] + "\n", VALUE_END[parser] + "\nstray", 1)
    rest = body[body.index("stray") - 1:]  # the rest as written
    assert whole(parser, body) == [("get_weather", '{"city": "Paris"', rest,
                                    "invalid_markup: text between parameters")]
    assert summary([p for _, p in stream(parser, body)]) == whole(parser, body)


@pytest.mark.parametrize("parser", XML)
def test_a_value_left_open_when_the_block_closes(parser):
    body = call(parser, ("city", "Paris"))
    body = body[:body.index("Paris") + 5]
    assert whole(parser, body) == [("get_weather", '{"city": "Paris"}', "",
                                    "invalid_markup: a parameter is not closed")]
    assert whole(parser, body, closed=False) == [("get_weather", '{"city": "Paris', "",
                                                  "truncated")]
