"""The model runner: one forward pass for a prompt chunk of one sequence, or for one new token of
every decoding sequence at once. Pure model-and-cache work: no threads, no requests.
"""

from __future__ import annotations

import logging
from itertools import accumulate
from typing import Sequence

import mlx.core as mx

from kv_cache import CacheManager
from kv_cache.hooks import (PagedSequence, batch_caches, finish_batch, forward, install,
                            ragged_caches)

from .features import ImageFeatures

log = logging.getLogger("mlx_kvserver.runner")


SPLIT_LAST = 16  # a prompt's last piece longer than this runs its last token alone


def _arrays(state) -> list[mx.array]:
    """The arrays of a layer cache's ``state`` (a tuple or list of arrays, some None)."""
    if isinstance(state, mx.array):
        return [state]
    return [a for a in (state or ()) if isinstance(a, mx.array)]


class Runner:
    """Runs one model. ``batched`` says whether many sequences decode in one forward pass and
    read shared prefixes through views: true when the model's attention is routed through
    ``kv_cache.model.attention`` and a probe at start-up gives the same logits batched as alone.
    Then the manager's sequences read shared prefixes through views from here on (the probe's own
    sequences read none)."""

    def __init__(self, model, manager: CacheManager, name: str = "model"):
        self.model = model
        # a vision model's image features, kept by image in the cache (``features.py``)
        self.features = ImageFeatures(manager, model) \
            if getattr(model, "reader", None) is not None else None
        self.ragged = False  # verify passes of several sequences: one row per token (``verify``)
        self.batched = install(model) and self._probe(manager)
        # several short prompts in one forward pass (right-padded): attention layers only
        self.batched_prompts = self.batched and not manager.has_state
        if self.batched:
            manager.share_prefixes()
        else:
            log.info("%s decodes one sequence per forward pass (its attention is not routed)",
                     name)

    def prefill(self, seq: PagedSequence, tokens: Sequence[int],
                logits: bool = True, images=None) -> mx.array | None:
        """Run ``tokens`` on ``seq``; the last position's logits (evaluated), or None where
        ``logits`` is false.

        Positions whose logits nobody reads have only the caches' state evaluated: MLX then
        computes for them neither the output head nor the last layer (the cache holds that
        layer's keys and values, which come from the layer before), as mlx-lm's own prompt pass
        does. On a 24,000-token prompt of a 2-layer model that halved the prefill; on the
        default model it saves one of 30 layers and the head (a 49,152-token vocabulary). So a
        piece whose logits are read runs its last token alone, when it is longer than
        ``SPLIT_LAST`` (a short one is not worth a second pass).

        ``images``: the prompt's ``ImagePrompt`` when it has images (``models/image_prompt.py``:
        the piece's positions, and its images' features in place of their tokens' embeddings;
        the piece holds each of its images whole)."""
        if not logits or (len(tokens) > SPLIT_LAST
                          and not self._inside_image(images, len(seq.tokens) + len(tokens) - 1)):
            body = tokens if not logits else tokens[:-1]
            with forward():
                caches = seq.prepare()
                self.model(mx.array(list(body))[None], cache=caches,
                           **self._inputs([seq], body, images))
                mx.eval([a for c in caches for a in _arrays(c.state)])
            seq.append_tokens(body)
            if not logits:
                return None
            tokens = tokens[-1:]
        with forward():
            out = self.model(mx.array(list(tokens))[None], cache=seq.prepare(),
                             **self._inputs([seq], tokens, images))[0, -1]
            mx.eval(out)
        seq.append_tokens(tokens)
        return out

    def prefill_many(self, seqs: Sequence[PagedSequence], pieces: Sequence[Sequence[int]],
                     logits: Sequence[bool] | None = None,
                     images: Sequence | None = None) -> list[mx.array | None]:
        """Prompt pieces of several sequences in one forward pass (``_pass``: ragged where that
        saves rows, e.g. the next turns of cached conversations, 1-31 new tokens each); each
        one's last logits (for one sequence, None where ``logits`` says nobody reads them).
        Pieces of prompts with images (``images``: each piece's ``ImagePrompt`` or None) run
        one a pass, with their own positions and features."""
        if len(seqs) == 1 or (images and any(i is not None for i in images)):
            return [self.prefill(s, p, logits[i] if logits else True,
                                 images[i] if images else None)
                    for i, (s, p) in enumerate(zip(seqs, pieces))]
        rows = [out[-1] for out in self._pass(seqs, pieces)]
        mx.eval(rows)
        return rows

    def verify(self, seqs: Sequence[PagedSequence],
               pieces: Sequence[Sequence[int]]) -> list[mx.array]:
        """Each sequence's piece (its last token and a draft) in one forward pass; every
        position's logits, ``[len(piece), vocab]`` each (lazy). The caller trims the positions
        of rejected draft tokens (``PagedSequence.trim``)."""
        if len(seqs) == 1:
            with forward():
                out = self.model(mx.array(list(pieces[0]))[None], cache=seqs[0].prepare(),
                                 **self._inputs(seqs, pieces[0]))[0]
            seqs[0].append_tokens(pieces[0])
            return [out]
        return self._pass(seqs, pieces)

    def _pass(self, seqs: Sequence[PagedSequence],
              pieces: Sequence[Sequence[int]]) -> list[mx.array]:
        """Several sequences' pieces in one forward pass: every position's logits, ``[len(piece),
        vocab]`` each (lazy). Ragged where the cache allows it (``self.ragged``) and it saves rows
        (``pass_rows``): ``ragged_caches``, one row per token, so pieces of different lengths
        cost their own rows, never the longest's; else right-padded to the longest."""
        lengths = [len(p) for p in pieces]
        T = max(lengths)
        if self.pass_rows(lengths) < len(seqs) * T:
            with forward():
                flat = mx.array([t for p in pieces for t in p])[:, None]
                logits = self.model(flat, cache=ragged_caches(seqs, lengths),
                                    **self._inputs(seqs, lengths=lengths))[:, 0]
            starts = accumulate(lengths, initial=0)
            out = [logits[a : a + n] for a, n in zip(starts, lengths)]
        else:
            padded = mx.array([list(p) + [0] * (T - len(p)) for p in pieces])
            with forward():
                logits = self.model(padded, cache=batch_caches(seqs, lengths),
                                    **self._inputs(seqs))
            out = [logits[i, :n] for i, n in enumerate(lengths)]
        for seq, p in zip(seqs, pieces):
            seq.append_tokens(p)
        return out

    def pass_rows(self, lengths: Sequence[int]) -> int:
        """The token rows of a pass over pieces of ``lengths`` (``_pass``): ragged where that
        saves a quarter of the padded rows or more (a ragged pass of equal pieces measured 5-10%
        slower than a padded one: its rows regrouped at every layer; measured by hand with the
        code of benchmarks/ragged_pass.py, in docs/BENCHMARKS.md's git history)."""
        padded = len(lengths) * max(lengths)
        real = sum(lengths)
        return real if self.ragged and len(lengths) > 1 and 4 * real <= 3 * padded else padded

    def decode(self, seqs: Sequence[PagedSequence], tokens: Sequence[int]) -> mx.array:
        """One new token per sequence; logits ``[len(seqs), vocab]`` (lazy)."""
        with forward():
            if len(seqs) == 1:
                logits = self.model(mx.array([[tokens[0]]]), cache=seqs[0].prepare(),
                                    **self._inputs(seqs))[:, -1]
            else:
                caches = batch_caches(seqs)
                logits = self.model(mx.array(list(tokens))[:, None], cache=caches,
                                    **self._inputs(seqs))[:, -1]
                finish_batch(seqs, caches)
        for seq, t in zip(seqs, tokens):
            seq.append_tokens([t])
        return logits

    def _inputs(self, seqs: Sequence[PagedSequence], piece: Sequence[int] = (), images=None,
                lengths: Sequence[int] | None = None) -> dict:
        """The model's keyword arguments beside the tokens and caches: a prompt piece's with
        images (``ImagePrompt.inputs``, at the sequence's length; its images' features kept by
        image, ``features.py``), else each row's ``rope_deltas`` where a sequence's positions
        run past its index (a sequence after an image: ``rope_delta``, set by the scheduler);
        one per token for a ragged pass (``lengths``). None of them for text."""
        if images is not None:
            return images.inputs(self.model, piece, len(seqs[0].tokens),
                                 self.features.encode if self.features is not None else None)
        deltas = [getattr(s, "rope_delta", 0) for s in seqs]
        if not any(deltas):
            return {}
        if lengths is not None:
            deltas = [d for d, n in zip(deltas, lengths) for _ in range(n)]
        return {"rope_deltas": mx.array(deltas, dtype=mx.int32)}

    @staticmethod
    def _inside_image(images, position: int) -> bool:
        """Whether ``position`` of a prompt with ``images`` holds an image's token (a piece
        whose last token does runs whole: its image is not cut)."""
        return images is not None and any(s.start <= position < s.end for s in images.spans)

    def _probe(self, manager: CacheManager) -> bool:
        """Two sequences of different lengths, decoded alone and then in one batch: the model
        batches when the logits agree. Then pieces of 3 and 1 tokens verified alone and in one
        ragged pass: verify passes are ragged (``self.ragged``) when those agree too."""
        seqs = [manager.new_sequence() for _ in range(4)]
        try:
            prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
            for s, p in zip(seqs, prompts + prompts):
                self.prefill(s, p)
            alone = mx.concatenate([self.decode([seqs[0]], [9]), self.decode([seqs[1]], [10])])
            if not _agree(alone, self.decode(seqs[2:], [9, 10])):
                return False
            self.ragged = manager.can_go_ragged() and self._ragged_agrees(seqs)
            return True
        except Exception as e:  # a model that indexes its cache in ways a batch cannot serve
            log.info("batched decode probe failed: %s", e)
            return False
        finally:
            for s in seqs:
                s.close()

    def _ragged_agrees(self, seqs: list[PagedSequence]) -> bool:
        """Pieces of 3 and 1 tokens on ``seqs[:2]`` alone and on ``seqs[2:]`` (the same
        contexts) in one ragged pass: whether the logits agree."""
        self.ragged = True
        try:
            pieces = [[11, 12, 13], [14]]
            alone = mx.concatenate([self.verify([s], [p])[0] for s, p in zip(seqs, pieces)])
            if _agree(alone, mx.concatenate(self.verify(seqs[2:], pieces))):
                return True
            log.info("verify passes are padded: a ragged one disagreed with each alone")
        except Exception as e:
            log.info("verify passes are padded: a ragged one failed: %s", e)
        return False


def _agree(a: mx.array, b: mx.array) -> bool:
    """Logits the same but for rounding (a hundredth of their largest)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return mx.abs(a - b).max().item() <= 1e-2 * (mx.abs(a).max().item() or 1.0)
