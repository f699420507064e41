"""The model runner: one forward pass for a prompt chunk of one sequence, or for one new token of
every decoding sequence at once. Pure model-and-cache work: no threads, no requests.
"""

from __future__ import annotations

import logging
from typing import Sequence

import mlx.core as mx

from kv_cache import CacheManager, PagedSequence, batch_caches, finish_batch, forward, install

log = logging.getLogger("mlx_kvserver.runner")


class Runner:
    """Runs one model. ``batched`` says whether many sequences decode in one forward pass and
    read shared prefixes through views: true when the model's attention is routed through
    ``kv_cache.model.attention`` and a probe at start-up gives the same logits batched as alone.
    Then the manager's sequences read shared prefixes through views from here on (the probe's own
    sequences read none)."""

    def __init__(self, model, manager: CacheManager, name: str = "model"):
        self.model = model
        self.batched = install(model) and self._probe(manager)
        # several short prompts in one forward pass (right-padded): attention layers only
        self.batched_prompts = self.batched and not manager.pool.spec.has_state
        if self.batched:
            manager.share_prefixes()
        else:
            log.info("%s decodes one sequence per forward pass (its attention is not routed)",
                     name)

    def prefill(self, seq: PagedSequence, tokens: Sequence[int]) -> mx.array:
        """Run ``tokens`` on ``seq``; the last position's logits (evaluated)."""
        with forward():
            logits = self.model(mx.array(list(tokens))[None], cache=seq.prepare())[0, -1]
            mx.eval(logits)
        seq.append_tokens(tokens)
        return logits

    def prefill_many(self, seqs: Sequence[PagedSequence],
                     pieces: Sequence[Sequence[int]]) -> list[mx.array]:
        """Prompt pieces of several sequences in one forward pass; each one's last logits."""
        if len(seqs) == 1:
            return [self.prefill(seqs[0], pieces[0])]
        T = max(len(p) for p in pieces)
        padded = mx.array([list(p) + [0] * (T - len(p)) for p in pieces])
        lengths = [len(p) for p in pieces]
        with forward():
            logits = self.model(padded, cache=batch_caches(seqs, lengths))
            rows = logits[mx.arange(len(seqs)), mx.array(lengths) - 1]
            mx.eval(rows)
        for seq, p in zip(seqs, pieces):
            seq.append_tokens(p)
        return [rows[i] for i in range(len(seqs))]

    def decode(self, seqs: Sequence[PagedSequence], tokens: Sequence[int]) -> mx.array:
        """One new token per sequence; logits ``[len(seqs), vocab]`` (lazy)."""
        with forward():
            if len(seqs) == 1:
                logits = self.model(mx.array([[tokens[0]]]), cache=seqs[0].prepare())[:, -1]
            else:
                caches = batch_caches(seqs)
                logits = self.model(mx.array(list(tokens))[:, None], cache=caches)[:, -1]
                finish_batch(seqs, caches)
        for seq, t in zip(seqs, tokens):
            seq.append_tokens([t])
        return logits

    def _probe(self, manager: CacheManager) -> bool:
        """Two sequences of different lengths, decoded alone and then in one batch: the model
        batches when the logits agree."""
        seqs = [manager.new_sequence() for _ in range(4)]
        try:
            prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
            for s, p in zip(seqs, prompts + prompts):
                self.prefill(s, p)
            alone = mx.concatenate([self.decode([seqs[0]], [9]), self.decode([seqs[1]], [10])])
            together = self.decode(seqs[2:], [9, 10])
            diff = mx.abs(alone.astype(mx.float32) - together.astype(mx.float32)).max().item()
            scale = mx.abs(alone.astype(mx.float32)).max().item() or 1.0
            return diff <= 1e-2 * scale
        except Exception as e:  # a model that indexes its cache in ways a batch cannot serve
            log.info("batched decode probe failed: %s", e)
            return False
        finally:
            for s in seqs:
                s.close()
