"""A draft model (``--draft-model``): a small model with the served model's tokenizer that
proposes drafts where the conversation has nothing to offer (``speculate.py``).

It runs on a paged cache of its own from the same library (its own pool, no disk), one sequence
per answer kept in step with the answer: before each draft the sequence is cut back to what it
shares with the answer's tokens and reads the rest, then it decodes the draft greedily, every
answer that wants a draft in the same forward passes. A finished answer's sequence is saved
under the answer's id, so the next turn's draft sequence starts from it (by id or by content).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import mlx.core as mx

from kv_cache import open_cache
from ...config import GB, ServerConfig
from ..runner import Runner

log = logging.getLogger("mlx_kvserver.engine")

CATCH_UP = 512  # the most tokens a draft sequence reads in one step before it drafts


class DraftModelError(ValueError):
    """The draft model cannot draft for the served model (another tokenizer, recurrent state)."""


def check_draft_model(draft: Any, target: Any) -> None:
    """``DraftModelError`` unless ``draft`` (a loaded model) can draft for ``target``: the same
    vocabulary, token for token, and the same end tokens; a cache it can cut back."""
    dv, tv = draft.tokenizer.hf.get_vocab(), target.tokenizer.hf.get_vocab()
    if dv != tv:
        diff = len(set(dv.items()) ^ set(tv.items()))
        raise DraftModelError(
            f"draft model {draft.name!r} has another tokenizer than {target.name!r} "
            f"({len(dv)} and {len(tv)} tokens, {diff} entries differ): a draft model must "
            "share the served model's tokenizer")
    if not set(draft.tokenizer.eos_token_ids) & set(target.tokenizer.eos_token_ids):
        raise DraftModelError(f"draft model {draft.name!r} ends turns with other tokens than "
                              f"{target.name!r}")
    if draft.cache_spec is not None and draft.cache_spec.has_state:
        raise DraftModelError(f"draft model {draft.name!r} keeps a recurrent state, which "
                              "cannot go back to a rejected draft's position")


class DraftModel:
    """One draft model's cache and runner; :meth:`propose` drafts for many answers at once."""

    def __init__(self, lm: Any, config: ServerConfig) -> None:
        self.lm, self.name = lm, lm.name
        self.manager = open_cache(
            lm.cache_spec, lm.fingerprint, page_size=config.page_size,
            max_ram_bytes=max(64 << 20, int(config.max_kv_ram_gb * GB) // 4), policy="lru",
            disk_dir=None, max_disk_bytes=0, max_resident=0)
        self.runner = Runner(lm.model, self.manager, lm.name)
        self.passes = 0

    def propose(self, wants: Sequence[tuple[Any, list[int], int]]) -> list[list[int]]:
        """Greedy drafts of ``k`` tokens to follow each ``context`` (``wants``: (holder, context,
        k); ``holder.draft_seq`` keeps the answer's draft sequence). An answer whose sequence is
        still reading its context gets no draft this step."""
        ready, drafts = [], [[] for _ in wants]
        for i, (holder, ctx, k) in enumerate(wants):
            if self._catch_up(holder, ctx):
                ready.append(i)
        if not ready:
            return drafts
        seqs = [wants[i][0].draft_seq for i in ready]
        tokens = [wants[i][1][-1] for i in ready]
        left = {i: wants[i][2] for i in ready}
        vocab = wants[ready[0]][0].request.support.vocab_size
        while ready:
            groups = [ready] if self.runner.batched else [[i] for i in ready]
            nxt: dict[int, int] = {}
            for group in groups:
                logits = self.runner.decode([seqs[ready.index(i)] for i in group],
                                            [tokens[ready.index(i)] for i in group])
                ids = mx.argmax(logits, axis=-1).tolist()
                self.passes += 1
                nxt.update(zip(group, ids))
            keep, keep_seqs, keep_tokens = [], [], []
            for i in ready:
                t = int(nxt[i])
                if t >= vocab or t in wants[i][0].request.lm.tokenizer.eos_token_ids:
                    continue  # no draft past the end of the answer
                drafts[i].append(t)
                left[i] -= 1
                if left[i] > 0:
                    keep.append(i)
                    keep_seqs.append(seqs[ready.index(i)])
                    keep_tokens.append(t)
            ready, seqs, tokens = keep, keep_seqs, keep_tokens
        return drafts

    def _catch_up(self, holder: Any, ctx: list[int]) -> bool:
        """Bring the draft sequence to ``ctx`` less its last token (cut back to what they share,
        then read the rest, ``CATCH_UP`` tokens a step); whether it got there."""
        seq = holder.draft_seq
        if seq is None:
            r = holder.request
            seq, _ = self.manager.start(ctx[:-1], r.keys, use_cache=True)
            holder.draft_seq = seq
        n = 0
        limit = min(len(seq.tokens), len(ctx) - 1)
        while n < limit and seq.tokens[n] == ctx[n]:
            n += 1
        if n < len(seq.tokens):
            seq.trim(len(seq.tokens) - n)
        missing = ctx[n:len(ctx) - 1]
        if missing:
            piece = missing[:CATCH_UP]
            self.runner.prefill(seq, piece, logits=False)
            self.passes += 1
            return len(piece) == len(missing)
        return True

    def finished(self, holder: Any, key: str | None) -> None:
        """The answer is done: its draft sequence is saved under ``key`` (the next turn starts
        from it) and closed."""
        seq, holder.draft_seq = holder.draft_seq, None
        if seq is None:
            return
        try:
            if key:
                self.manager.save(key, seq)
        except Exception as e:  # a draft cache that is full only costs the next turn its reuse
            log.info("draft sequence not kept: %s", e)
        seq.close()

    def close(self) -> None:
        self.manager.close()
