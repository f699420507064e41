"""Token-id helpers: a common prefix found in chunks agrees with the one-by-one answer."""

import random

import numpy as np
import pytest

from kv_cache.tokens import _CHUNK, common_prefix, token_list


def reference(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("n", [0, 1, _CHUNK - 1, _CHUNK, _CHUNK + 1, 3 * _CHUNK + 7])
def test_common_prefix_matches_one_by_one(n):
    rng = random.Random(n)
    a = [rng.randrange(50_000) for _ in range(n)]
    cuts = {0, n // 2, n - 1, n, _CHUNK - 1, _CHUNK, _CHUNK + 1} - {-1}
    for cut in sorted(c for c in cuts if 0 <= c <= n):
        b = a[:cut] + [50_001] + a[cut + 1 :]  # differs first at ``cut`` (when cut < n)
        for x, y in ((a, b), (b, a), (tuple(a), b), (a, np.array(b, dtype=np.int32)),
                     (a, b[: cut + 1]), (a[:cut], b)):
            assert common_prefix(x, y) == reference(x, y)
    assert common_prefix(a, a + [1]) == n and common_prefix([], a) == 0


def test_token_list_gives_python_ints_and_refuses_others():
    got = token_list(np.array([3, 70_000], dtype=np.int64))
    assert got == [3, 70_000] and all(type(t) is int for t in got)
    assert token_list((1, 2)) == [1, 2] and token_list([]) == []
    with pytest.raises(TypeError):
        token_list([1.5])
