"""One memory budget for the server: :class:`MemoryBudget`.

What the server may use (``--memory-limit``, by default a safe fraction of the machine: on
Metal, of what MLX recommends as its working set) is spent on the models' weights, the KV pages,
the running sequences' working buffers, MLX's buffer cache and the next forward pass's peak. MLX
counts everything it allocates (``mx.get_active_memory``); what the next pass will add on top is
estimated from its shape before it runs (:meth:`MemoryBudget.pass_peak`: a chunk's activations
and attention scores, growing with chunk x context, and the keys and values it writes; and for
a chunk holding an image whose features are not kept, the vision encoder's own pass over its
patches, :meth:`MemoryBudget.encoder_peak`). The
scheduler asks before each pass whether it fits (``engine/pressure.py`` says what it does when
not), and MLX's own limits are set from the budget (``mx.set_memory_limit``; the wired limit on
Metal).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kv_cache.hooks import OWN_KEYS_APART

from ..models.footprint import weights_bytes
from ..platform import heap
from ..platform.memory_facts import MemoryFacts, current

log = logging.getLogger("mlx_kvserver.engine")

GB = 1 << 30
DEFAULT_FRACTION = 0.75  # of the machine's memory (Metal: of MLX's recommended working set)
# NOTE: what the process may add outside MLX between two of the budget's checks (it measures the
# process's resident memory at each): up to ~15 MiB above the last check under four concurrent
# long prompts under pressure on this machine's CPU backend (earlier runs of
# benchmarks/memory_peak.py, in docs/BENCHMARKS.md's git history), so the budget keeps twice that
# free. Not measured on Metal.
MARGIN = 32 << 20
# NOTE: MLX's buffer cache (freed arrays kept for reuse) grows during a pass, between two checks,
# and on the CPU backend MLX's memory limit does not hold it: it may grow only into what the
# budget has free beyond this much room for the next pass (none of it under pressure).
PASS_ROOM = 128 << 20


def default_limit(facts: MemoryFacts | None = None) -> int:
    """``DEFAULT_FRACTION`` of the machine's memory (Metal: of MLX's recommended working set);
    ``facts``: the machine's (None: this one's, read now)."""
    return int((facts or current()).budget_base * DEFAULT_FRACTION)


@dataclass(frozen=True)
class Shape:
    """What a model's pass costs per token: from its config (mlx-lm's ``args``)."""

    hidden: int
    intermediate: int
    heads: int
    layers: int
    vocab: int
    kv_bytes: int  # keys and values of one position, all layers (working buffer precision)
    dtype_bytes: int

    @classmethod
    def of(cls, lm: Any) -> "Shape":
        args = getattr(lm.model, "args", None)
        text = getattr(args, "text_config", None)
        a = text if isinstance(text, dict) else vars(args) if args is not None else {}

        def get(*names, default: int) -> int:
            for n in names:
                v = a.get(n) if isinstance(a, dict) else None
                if isinstance(v, int) and v > 0:
                    return v
            return default
        hidden = get("hidden_size", "d_model", default=2048)
        dt = lm.dtype.size if hasattr(lm.dtype, "size") else 4
        spec = lm.cache_spec
        kv = sum(len(g.layers) * 2 * g.num_kv_heads * g.head_dim * dt for g in spec.groups) \
            if spec is not None else lm.num_layers * 2 * lm.num_kv_heads * lm.head_dim * dt
        return cls(hidden, get("intermediate_size", "ffn_dim", default=4 * hidden),
                   get("num_attention_heads", "n_heads", default=max(1, hidden // 64)),
                   get("num_hidden_layers", "n_layers", default=lm.num_layers),
                   get("vocab_size", default=32000), kv, dt)


@dataclass(frozen=True)
class Vision:
    """What a vision tower's pass over one image costs per patch: from its config (mlx-vlm's
    ``vision_config``)."""

    hidden: int
    intermediate: int
    heads: int
    out_hidden: int

    @classmethod
    def of(cls, lm: Any) -> "Vision | None":
        """``lm``'s vision tower (None for a model that reads no images)."""
        vlm = getattr(lm.model, "vlm", None)
        cfg = getattr(getattr(vlm, "config", None), "vision_config", None)
        if cfg is None or not getattr(lm, "takes_images", False):
            return None
        a = cfg if isinstance(cfg, dict) else vars(cfg)

        def get(*names, default: int) -> int:
            for n in names:
                v = a.get(n)
                if isinstance(v, int) and v > 0:
                    return v
            return default
        hidden = get("hidden_size", "embed_dim", "width", default=1280)
        return cls(hidden, get("intermediate_size", default=4 * hidden),
                   get("num_heads", "num_attention_heads", default=max(1, hidden // 64)),
                   get("out_hidden_size", "projection_dim", default=hidden))


class ModelTooLarge(ValueError):
    """A model whose load would not fit in what the memory limit leaves free."""


def give_back(trim: bool = True) -> None:
    """MLX's buffer cache back to the system, and (``trim``) what that frees through the C
    allocator: a buffer MLX frees may sit in the allocator's heaps, resident, when it was
    carved from free chunks an earlier trim left there (``platform/heap.py``) instead of pages
    mapped for it, so the process's resident memory, which the budget reads, falls only once
    they are handed back too."""
    mx.clear_cache()
    if trim:
        heap.give_back()


class MemoryBudget:
    """The server's limit and what is spent of it. ``limit``: bytes (None: ``default_limit``);
    ``facts``: the machine's memory (None: this machine's, ``platform/memory_facts.py``).
    Models register their weights as they load and unload."""

    def __init__(self, limit: int | None = None, reserve: int | None = None,
                 facts: MemoryFacts | None = None) -> None:
        self.facts = facts or current()
        self.limit = int(limit) if limit else default_limit(self.facts)
        self.reserve = reserve  # --memory-reserve: what ``outside`` is (None: measured)
        self.machine = self.facts.total
        self.device = self.facts.working_set
        self.weights: dict[str, int] = {}
        self.shapes: dict[str, Shape] = {}
        self.visions: dict[str, Vision] = {}  # the vision towers of models that read images
        self.refused = 0  # requests refused because they cannot fit even alone
        self.pressure_events = 0
        self.load_peak = 0  # the most MLX held while a model was loading
        self.load_estimate = 0  # the most a model's load was estimated to hold (its files)
        self.outside = reserve or 0  # what the process holds outside MLX (``measure_outside``)
        # kept free for what grows between two checks (none with a fixed --memory-reserve)
        self.margin = 0 if reserve is not None else MARGIN
        self._measured = False  # whether the process's resident memory was read
        self._mlx_limit = 0  # MLX's own limit as last set
        self._cache_limit = -1  # MLX's buffer cache limit as last set
        self.shedders: dict[str, Any] = {}  # per model: what it gives back (Scheduler.shed)

    @classmethod
    def of(cls, config: Any) -> "MemoryBudget":
        """The budget a ``ServerConfig`` sets (``--memory-limit``, ``--memory-reserve``)."""
        limit, reserve = config.memory_limit_gb, config.memory_reserve_gb
        return cls(int(limit * GB) if limit else None,
                   None if reserve is None else int(reserve * GB))

    def measure_outside(self) -> int:
        """What the process holds outside MLX (Python, the tokenizers, libraries): its resident
        memory (``facts.resident()``: on macOS its footprint, where MLX's Metal buffers are
        counted) less MLX's active and cached bytes, measured now (after a model loads). It is
        part of the budget: MLX gets the rest. ``--memory-reserve`` fixes it instead."""
        if self.reserve is not None:
            return self.outside
        resident = self.facts.resident()
        self._measured = bool(resident)
        if not resident:  # an odd platform: MLX's bytes alone, as before
            log.info("the process's resident memory is not known (%s)", self.facts.system)
            return self.outside
        self.outside = max(0, resident - int(mx.get_active_memory()) - int(mx.get_cache_memory()))
        return self.outside

    def apply(self) -> None:
        """Set MLX's own limits from the budget (and the wired limit on Metal), what the
        process holds outside MLX set aside."""
        self.measure_outside()
        self._mlx_limit = max(self.limit - self.outside - self.margin, 1 << 26)
        mx.set_memory_limit(self._mlx_limit)
        wired = self.facts.wired_limit(self.limit)
        if wired is not None:
            try:
                mx.set_wired_limit(wired)
            except (AttributeError, RuntimeError, ValueError) as e:
                log.info("the wired limit was not set: %s", e)
        log.info("memory limit %.2f GB (machine %.2f GB%s)", self.limit / GB,
                 self.machine / GB, f", Metal working set {self.device / GB:.2f} GB"
                 if self.device else "")

    def add_model(self, lm: Any) -> None:
        self.weights[lm.name] = weights_bytes(lm.model)
        self.shapes[lm.name] = Shape.of(lm)
        vision = Vision.of(lm)
        if vision is not None:
            self.visions[lm.name] = vision
        # NOTE: MLX's peak is never reset: ``mlx_peak_bytes`` is the most MLX held since the
        # process started, its loads included (each checked before it allocates: ``check_load``)
        self.load_peak = max(self.load_peak, getattr(lm, "load_peak", 0)
                             or int(mx.get_peak_memory()))
        self.load_estimate = max(self.load_estimate, getattr(lm, "load_peak_estimate", 0))

    def check_load(self, name: str, estimate: Any) -> None:
        """Before a model loads, nothing of it allocated: its load's peak (``estimate.peak``,
        from its files: ``models/footprint.py``) must fit in what the limit leaves beside what
        the process holds now (its resident memory, MLX's buffer cache given back first; or
        MLX's bytes and ``--memory-reserve``) and the margin. ``ModelTooLarge`` otherwise."""
        give_back()
        held = int(mx.get_active_memory()) + self.measure_outside()
        if held + self.margin + estimate.peak > self.limit:
            def mib(n: int) -> str:
                return f"{n / (1 << 20):.0f} MiB"
            raise ModelTooLarge(
                f"model {name} does not fit: its load would hold about {mib(estimate.peak)} at "
                f"its peak ({mib(estimate.weights)} of weights once loaded), and the process "
                f"holds {mib(held)} of the memory limit's {mib(self.limit)} ({mib(self.margin)} "
                "kept free): raise --memory-limit, or serve a smaller model")

    def remove_model(self, name: str) -> None:
        self.weights.pop(name, None)
        self.shapes.pop(name, None)
        self.visions.pop(name, None)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    def shed(self) -> int:
        """Every model gives back what nothing running needs (its prepared next turns, what its
        cache holds that nothing needs); the pages freed."""
        return sum(fn() for fn in self.shedders.values())

    def in_use(self) -> int:
        """What the budget counts as held now: MLX's active bytes (weights, pages, buffers), its
        buffer cache (freed arrays kept for reuse: resident until given back, which
        ``Pressure.fits`` does first) and what the process holds outside MLX, or where it is
        more, the process's resident memory now (what serving adds outside MLX: request objects,
        threads' arenas, ~20-80 MB under a few long prompts here), and the ``margin`` kept free
        for what the process adds between two checks. MLX's own limit follows what is left for
        it (``_follow``), so its cache and a pass's temporaries stay within the budget too. With
        ``--memory-reserve``: MLX's bytes and the reserve alone."""
        active = int(mx.get_active_memory())
        cache = int(mx.get_cache_memory())
        used = active + cache + self.outside
        if self.reserve is None and self._measured:
            resident = self.facts.resident()
            if resident:
                self._follow(max(self.outside, resident - active - cache))
                used = max(used, resident)
        used += self.margin
        self._bound_cache(used, cache)
        return used

    @property
    def cache_limit(self) -> int:
        """MLX's buffer cache limit as this budget last set it (-1: not set yet)."""
        return self._cache_limit

    def _bound_cache(self, used: int, cache: int) -> None:
        """MLX's buffer cache may hold what it holds now and grow into what the budget has free
        beyond ``PASS_ROOM`` (set again when that moved by 8 MB or more). ``used``: in use."""
        bound = cache + max(0, self.limit - used - PASS_ROOM)
        if abs(bound - self._cache_limit) >= 8 << 20 or (bound == 0) != (self._cache_limit == 0):
            mx.set_cache_limit(bound)
            self._cache_limit = bound

    def _follow(self, outside_now: int) -> None:
        """MLX's limit: the budget less what the process holds outside MLX now (set again when
        that moved by 8 MB or more)."""
        mlx_limit = max(self.limit - outside_now - self.margin, 1 << 26)
        if abs(mlx_limit - self._mlx_limit) >= 8 << 20:
            mx.set_memory_limit(mlx_limit)
            self._mlx_limit = mlx_limit

    def pass_peak(self, model: str, tokens: int, context: int, rows: int = 1) -> int:
        """What a pass of ``tokens`` new positions in each of ``rows`` sequences, after
        ``context`` positions, adds at its peak: the residual stream and one layer's attention
        scores and MLP activations (float32), the keys and values it writes, and the logits of
        the last positions. An estimate from the shape, checked against ``mx.get_peak_memory``
        in tests/engine/test_memory.py."""
        s = self.shapes[model]
        n = tokens * rows
        f = 4  # activations and scores are computed in float32 on the CPU, often on GPUs too
        acts = n * (6 * s.hidden + 3 * s.intermediate) * f
        scores = 3 * rows * s.heads * tokens * (context + tokens) * f
        kv = n * s.kv_bytes
        logits = rows * min(tokens, 16) * s.vocab * f
        # a batch's own keys padded into one array, one layer: below OWN_KEYS_APART positions
        # (from there on each sequence's are read where they are: kv_cache.model.attention)
        padded = rows * (context + tokens) * s.kv_bytes // max(1, s.layers) \
            if 1 < rows and context + tokens < OWN_KEYS_APART else 0
        return acts + scores + kv + logits + padded

    def encoder_peak(self, model: str, patches: int) -> int:
        """What the vision encoder adds at its peak over one image of ``patches`` patches
        (``model``'s tower; 0 for a model without one): the patches' residual stream and MLP
        activations, one block's attention scores over the whole image (its full-attention
        blocks), and the features it hands on, float32 as ``pass_peak``'s. A features hit runs
        no encoder (``features.py``): only an image read afresh costs this."""
        v = self.visions.get(model)
        if v is None or patches <= 0:
            return 0
        f = 4
        acts = patches * (6 * v.hidden + 3 * v.intermediate) * f
        scores = 3 * v.heads * patches * patches * f
        return acts + scores + patches * v.out_hidden * f

    def request_floor(self, model: str, prompt: int, answer: int) -> int:
        """The least a request needs alone beyond the weights: its working buffers at the end
        (prompt and answer, every layer), the pages its positions are committed to (held while
        it runs, so the same bytes twice), and a pass of one small chunk at that context."""
        s = self.shapes[model]
        total = prompt + answer
        return 2 * total * s.kv_bytes + self.pass_peak(model, min(prompt, 32), total)

    def report(self) -> dict:
        return {"limit_bytes": self.limit, "machine_bytes": self.machine,
                "metal_working_set_bytes": self.device, "weights_bytes": self.weights_total,
                "weights_by_model": dict(self.weights),
                "mlx_active_bytes": int(mx.get_active_memory()),
                "mlx_cache_bytes": int(mx.get_cache_memory()),
                "mlx_peak_bytes": int(mx.get_peak_memory()), "load_peak_bytes": self.load_peak,
                "load_estimate_bytes": self.load_estimate,
                "outside_mlx_bytes": self.outside, "margin_bytes": self.margin,
                "refused": self.refused,
                "pressure_events": self.pressure_events}
