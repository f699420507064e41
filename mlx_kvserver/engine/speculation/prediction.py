"""Where an answer is in a client's prediction (OpenAI's Predicted Outputs): :class:`Prediction`.

OpenAI's ``accepted_prediction_tokens`` are the prediction's tokens that appeared in the
completion and ``rejected_prediction_tokens`` those that did not, so the two add up to the
prediction's length (per answer) and depend on the prediction and the answer only: not on the
drafts speculative decoding verified (``speculate.py`` counts those, whatever their source).

An answer is matched against the prediction as it is written, token by token, in order (a
monotonic alignment, so no prediction token counts twice): while the answer follows the
prediction, each token that equals the next one of it is matched; where the answer leaves it
(a word changed, lines added or left out), the prediction is found again at or after where the
answer left it: by the first token after a change of as many tokens as it replaced, else by the
answer's last tokens (:meth:`Prediction._find`). The count is a lower
bound of the longest common subsequence, equal to it on the edits an answer usually makes to a
prediction (a few tokens changed, added or removed in places), at O(1) a token, never a scan.
The same position is what the drafter drafts from (``drafts.py``): the prediction's tokens after
the last one matched, while the answer is in step with it.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

LOOSE = 8  # the answer tokens kept since the last match (what the prediction is found again by)
SWAP = 4  # the most tokens a change may replace with as many, found again by the one after
TRIES = 8  # occurrences of the last two tokens tried, from where the answer left the prediction


def _needed(gap: int) -> int:
    """Answer tokens that must agree with the prediction to find it again ``gap`` tokens on from
    where the answer left it: a far jump skips prediction tokens that could match later, so it
    needs more evidence than a near one."""
    return 2 if gap <= 16 else 3 if gap <= 128 else 4


class Prediction:
    """A client's prediction of one answer and where the answer is in it; :meth:`add` each
    token of the answer. ``accepted`` / ``rejected``: the prediction's tokens the answer has
    matched / not (so far)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.starts: dict[tuple[int, int], list[int]] = {}  # two tokens -> where they start
        for i in range(len(self.tokens) - 1):
            self.starts.setdefault((self.tokens[i], self.tokens[i + 1]), []).append(i)
        self.pos = 0  # the prediction's next token, the one the answer's next may match
        self.accepted = 0
        self.loose: list[int] = []  # the answer's tokens since its last match (the last LOOSE)

    @property
    def rejected(self) -> int:
        return len(self.tokens) - self.accepted

    @property
    def in_step(self) -> bool:
        """Whether the answer's last token was matched (or the answer has none yet): then the
        prediction's tokens from ``pos`` are its guess of what comes next."""
        return not self.loose

    def add(self, token: int) -> None:
        """The answer's next token."""
        if self.pos < len(self.tokens) and self.tokens[self.pos] == token:
            self.pos += 1
            self.accepted += 1
            self.loose.clear()
            return
        m = len(self.loose)  # a change of m tokens for m: the token after them is this one
        if 0 < m <= SWAP and self.pos + m < len(self.tokens) \
                and self.tokens[self.pos + m] == token:
            self.pos += m + 1
            self.accepted += 1
            self.loose.clear()
            return
        self.loose.append(token)
        if len(self.loose) > LOOSE:
            del self.loose[0]
        if len(self.loose) >= 2:
            self._find()

    def _find(self) -> None:
        """Find the prediction again where the answer's last two tokens occur in it at or after
        ``pos``, nearest first: the loose tokens that agree with the prediction before that
        point (at least ``_needed(gap)`` of them) are matched there."""
        at = self.starts.get((self.loose[-2], self.loose[-1]))
        if not at:
            return
        i = bisect_left(at, self.pos)
        for s in at[i:i + TRIES]:
            end = s + 2
            n = 2
            while n < len(self.loose) and end - n > self.pos \
                    and self.tokens[end - n - 1] == self.loose[-n - 1]:
                n += 1
            if n >= _needed(s - self.pos):
                self.pos, self.accepted = end, self.accepted + n
                self.loose.clear()
                return

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` of the prediction's tokens that follow the answer, while it is in step."""
        return self.tokens[self.pos:self.pos + k] if self.in_step else []
