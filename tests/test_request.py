"""Stop strings and the streaming hold-back."""

from mlx_kvserver.request import StopMatcher


def test_stop_matcher_finds_earliest_stop():
    m = StopMatcher(["END", "##"])
    assert m.find("abc ## def END", 0) == 4
    assert m.find("no stops here", 0) == -1
    assert m.find("xxEND", 3) == 2  # searches back far enough to catch a stop across chunks


def test_stop_matcher_holds_back_possible_prefix():
    m = StopMatcher(["END"])
    assert m.safe_end("hello EN") == len("hello ")
    assert m.safe_end("hello E") == len("hello ")
    assert m.safe_end("hello") == len("hello")
    assert StopMatcher([]).safe_end("abc") == 3
