"""What a load will hold (``models/footprint.py``): the weights estimated from the files, the
load's peak measured against its estimate (a conversion made a chunk of rows at a time), and a
load that would not fit refused before it allocates (``MemoryBudget.check_load``)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_kvserver import flags, server
from mlx_kvserver.engine.memory import GB, MemoryBudget, ModelTooLarge, weights_bytes
from mlx_kvserver.models import gguf
from mlx_kvserver.models.footprint import _gguf_elements, estimate_load, estimate_weights
from mlx_kvserver.models.loading import resolve_and_load
from tests.models.test_gguf import gguf_meta, to_gguf_names
from harness.tiny_model import make_tiny_model, make_tiny_model_dir


def quantized_dir(path: Path, **model_kw) -> Path:
    """A tiny model folder whose weights are 4-bit (group 32), as mlx-lm saves them."""
    q = make_tiny_model_dir(path, seed=0, **model_kw)
    model = make_tiny_model(seed=0, **model_kw)
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(q / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((q / "config.json").read_text())
    (q / "config.json").write_text(json.dumps({**cfg, "quantization": {"group_size": 32,
                                                                       "bits": 4}}))
    return q


def test_weights_estimated_from_the_files(tiny_model_dir: Path, tmp_path: Path):
    lm = resolve_and_load(str(tiny_model_dir))
    assert estimate_weights(tiny_model_dir, dequantize=True) == weights_bytes(lm.model)
    assert estimate_weights(tiny_model_dir, dequantize=False) == \
        (tiny_model_dir / "model.safetensors").stat().st_size
    q = quantized_dir(tmp_path / "q")  # 4-bit: its float32 size once dequantized
    deq = resolve_and_load(str(q), dequantize=True)
    assert estimate_weights(q, dequantize=True) == weights_bytes(deq.model)
    arrays = {"a": mx.zeros((3, 5)), "b": mx.zeros((7,))}  # a GGUF's tensors from its header
    mx.save_gguf(str(tmp_path / "m.gguf"), arrays, {"general.name": "m", "x.list": ["a", "bc"],
                                                    "n": mx.array(3, dtype=mx.uint32)})
    assert _gguf_elements(tmp_path / "m.gguf") == 22
    assert estimate_weights(tmp_path / "m.gguf", dequantize=True) == 88
    kept = estimate_load(tmp_path / "m.gguf", dequantize=False)
    assert kept.weights == 88 and kept.peak == 88 + 3 * 5 * 4 // 2  # "a" cast on a GPU


def measured_load(spec: str, dequantize: bool) -> tuple[int, int]:
    """(the load's MLX peak above what MLX held before it, the model's weights)."""
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()  # this load's own peak (a test, not the server: it never resets)
    lm = resolve_and_load(spec, dequantize=dequantize)
    assert lm.load_peak == mx.get_peak_memory()  # what the model says its load reached
    return lm.load_peak - base, weights_bytes(lm.model)


@pytest.mark.parametrize("kind", ["quantized folder", "float16 gguf"])
def test_a_load_peaks_at_its_weights_and_one_chunk_within_its_estimate(tmp_path, monkeypatch,
                                                                        kind):
    """Dequantized to float32 (what MLX's CPU backend runs), a tiny model's load peaks within
    its estimate, at about its weights plus one source tensor and one chunk's temporaries: a
    chunk of 64 KiB here, where converting the 4 MiB embedding whole held twice its size."""
    monkeypatch.setattr(gguf, "CHUNK_BYTES", 64 << 10)
    if kind == "quantized folder":
        path = quantized_dir(tmp_path / "q", hidden=256, vocab=4096)
        largest_f32 = 4096 * 256 * 4
    else:
        model = make_tiny_model(seed=3, hidden=256)
        model.set_dtype(mx.float16)
        path = tmp_path / "tiny.gguf"
        mx.save_gguf(str(path), to_gguf_names(model), {
            **gguf_meta(), "llama.embedding_length": mx.array(256, dtype=mx.uint32),
            "llama.feed_forward_length": mx.array(512, dtype=mx.uint32)})
        largest_f32 = max(v.size for _, v in tree_flatten(model.parameters())) * 4
    estimate = estimate_load(path, dequantize=True)
    peak, weights = measured_load(str(path), dequantize=True)
    assert estimate.weights == weights
    assert weights <= peak <= estimate.peak, (peak, estimate)
    assert estimate.peak - weights <= largest_f32 // 2 + gguf.conversion_workspace()
    if kind == "quantized folder":  # the embedding's float32 result: 4 MiB
        assert peak - weights < largest_f32 // 2, "a tensor was converted whole"


def test_a_load_that_would_not_fit_is_refused_before_it_allocates(tmp_path):
    q = quantized_dir(tmp_path / "q", hidden=256, vocab=4096)
    estimate = estimate_load(q, dequantize=True)
    mx.clear_cache()
    budget = MemoryBudget(mx.get_active_memory() + estimate.peak - (1 << 20), reserve=0)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    with pytest.raises(ModelTooLarge, match=f"model q does not fit: its load would hold about "
                       f"{estimate.peak / (1 << 20):.0f} MiB at its peak"):
        resolve_and_load(str(q), dequantize=True, fits=budget.check_load)
    assert mx.get_peak_memory() - base < 64 << 10  # nothing of it was allocated
    budget.limit += 2 << 20  # with room for it: it loads
    lm = resolve_and_load(str(q), dequantize=True, fits=budget.check_load)
    assert lm.load_peak_estimate == estimate.peak


def test_the_server_does_not_start_with_a_model_that_would_not_fit(tiny_model_dir):
    """At start the budget is built first and each load is checked against it."""
    args = flags.build_parser().parse_args(["--model", str(tiny_model_dir), "--no-disk-cache",
                                            "--memory-limit", f"{(32 << 20) / GB:.4f}"])
    with pytest.raises(SystemExit, match="does not fit: its load would hold about .* raise "
                       "--memory-limit"):
        server.load_engine(flags.config_from_args(args))
