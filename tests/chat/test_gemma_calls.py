"""Gemma 4's call reader (chat/gemma_calls.py): its syntax translated to JSON as it streams,
invalid text kept as written, and the quotes models slip into."""

from __future__ import annotations

from mlx_kvserver.chat.calls import Args
from tests.chat.test_calls import check_streams, stream, summary, whole
from tests.chat.test_xml_calls import GEMMA_P, GEMMA_R


def test_gemma4_translates_as_it_streams():
    got = check_streams("gemma4", GEMMA_P + GEMMA_R,
                        [("get_weather", '{"city":"Paris","days":3,"metric":true}'),
                         ("get_weather", '{"city":"Rome","opts":{"a":[1,"x"]}}')])
    assert (GEMMA_P.index("{") + 1, Args("{")) in got


def test_gemma4_invalid_json_midway():
    body = 'call:get_weather{city:<|"|>Paris<|"|>,,days:3}'
    for pieces in ([p for _, p in stream("gemma4", body)], None):
        got = summary(pieces) if pieces else whole("gemma4", body)
        assert got[0][0:2] == ("get_weather", '{"city":"Paris"')
        assert got[0][3] == "invalid_json: unexpected ',' where a key belongs"
    assert whole("gemma4", 'call:get_weather{city:<|"|>Par') == \
        [("get_weather", '{"city":"Par', "",
          "invalid_json: the arguments end before they are complete")]


def test_gemma4_invalid_json_keeps_the_text_as_written():
    body = 'call:get_weather{city:<|"|>Paris<|"|>,,days:3}'
    assert summary([p for _, p in stream("gemma4", body)])[0][2] == ",,days:3}"
    assert whole("gemma4", body)[0][2] == ",,days:3}"


def test_gemma4_slipped_quotes():
    body = "call:get_weather{city:'Paris',days:3}"
    assert whole("gemma4", body) == [("get_weather", '{"city":"Paris","days":3}', "", None)]
    assert whole("gemma4", 'call:get_weather{city:"Pa\\"ris"}')[0][1] == '{"city":"Pa\\"ris"}'
