"""What loading a model will hold, from its files alone, before anything loads: its weights once
loaded, and its load's peak (:class:`LoadEstimate`).

A load holds its source tensors as stored (a GGUF's quantized triples, or float16), then, where
it converts them (dequantizing to float32 on MLX's CPU backend, casting), each tensor's result is
written a chunk of rows at a time and swapped in for its source (``gguf.dequantize_to_float32``):
its peak is the weights, one source tensor and one chunk's temporaries. Checked against what MLX
measures in tests/models/test_footprint.py.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import gguf


def weights_bytes(model: Any) -> int:
    """Bytes of a loaded model's parameters (what loading it holds): what the estimates below
    foresee from the files."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@dataclass(frozen=True)
class LoadEstimate:
    """Bytes of MLX memory: ``weights`` once loaded; ``peak`` the most the load holds at once."""

    weights: int
    peak: int


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# NOTE: what MLX holds per element of a GGUF tensor of each type (``mx.load``): float32,
# float16; Q4_0, Q4_1 and Q8_0 as MLX's quantized triples of group 32 (packed weights with
# float16 scales and biases); every other type cast to float16
_GGUF_LOADED = {0: 4.0, 1: 2.0, 2: 0.625, 3: 0.625, 8: 1.125}


def _gguf_tensors(path: Path) -> list[tuple[int, int]]:
    """(elements, type) of every tensor of a GGUF file (v2/v3), read from its header alone."""
    with open(path, "rb") as f:
        def u(fmt: str) -> int:
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(kind: int) -> None:
            if kind == 8:  # a string
                f.seek(u("Q"), 1)
            elif kind == 9:  # an array
                inner, count = u("I"), u("Q")
                if inner in _GGUF_SIZES:
                    f.seek(count * _GGUF_SIZES[inner], 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                f.seek(_GGUF_SIZES[kind], 1)
        if f.read(4) != b"GGUF" or u("I") < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        tensors, kvs = u("Q"), u("Q")
        for _ in range(kvs):
            skip(8)
            skip(u("I"))
        out = []
        for _ in range(tensors):
            skip(8)
            dims = [u("Q") for _ in range(u("I"))]
            kind = u("I")
            f.seek(8, 1)  # offset
            n = 1
            for d in dims:
                n *= d
            out.append((n, kind))
        return out


def _gguf_elements(path: Path) -> int:
    """Elements of every tensor of a GGUF file, read from its header alone."""
    return sum(n for n, _ in _gguf_tensors(path))


def _gguf_estimate(path: Path, dequantize: bool) -> LoadEstimate:
    tensors = _gguf_tensors(path)
    loaded = [int(n * _GGUF_LOADED.get(kind, 2.0)) for n, kind in tensors]
    if not dequantize:
        # on a GPU the float32 tensors (norms) are cast to float16, one at a time
        f32 = max((b for b, (_, kind) in zip(loaded, tensors) if kind == 0), default=0)
        return LoadEstimate(sum(loaded), sum(loaded) + f32 // 2)
    weights = 4 * sum(n for n, _ in tensors)
    converted = [b for b, (_, kind) in zip(loaded, tensors) if kind != 0]
    extra = max(converted) + gguf.conversion_workspace() if converted else 0
    return LoadEstimate(weights, weights + extra)


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _safetensors_estimate(files: list[Path], config: dict[str, Any],
                          dequantize: bool) -> LoadEstimate:
    """A folder's weights as stored, or with ``dequantize`` in float32 (a quantized weight's
    elements: its scales' times the group size; scales and biases go), and the peak of the
    conversion (the largest tensor converted, a quantized one with its scales and biases)."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    header: dict[str, Any] = {}
    for file in files:
        with open(file, "rb") as f:
            header.update(json.loads(f.read(struct.unpack("<Q", f.read(8))[0])))
    header.pop("__metadata__", None)

    def stored(t: dict) -> int:
        n = 1
        for d in t["shape"]:
            n *= d
        return n * _DTYPE_BYTES.get(t["dtype"], 4)
    if not dequantize:
        return LoadEstimate(sum(p.stat().st_size for p in files),
                            sum(p.stat().st_size for p in files))
    weights, largest = 0, 0
    for name, t in header.items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases") and f"{base}.weight" in header:
            if leaf == "scales":
                layer = quant.get(base) if isinstance(quant.get(base), dict) else {}
                group = int(layer.get("group_size", quant.get("group_size", 64)))
                weights += stored(t) // _DTYPE_BYTES.get(t["dtype"], 4) * group * 4
                largest = max(largest, sum(stored(header[f"{base}.{k}"])
                                           for k in ("weight", "scales", "biases")
                                           if f"{base}.{k}" in header))
        elif leaf == "weight" and f"{base}.scales" in header:
            continue  # counted with its scales
        elif t["dtype"].startswith(("F", "BF")):
            weights += stored(t) // _DTYPE_BYTES.get(t["dtype"], 4) * 4
            if t["dtype"] != "F32":
                largest = max(largest, stored(t))
        else:
            weights += stored(t)
    extra = largest + gguf.conversion_workspace() if largest else 0
    return LoadEstimate(weights, weights + extra)


def estimate_load(path: Path, dequantize: bool) -> LoadEstimate:
    """What loading ``path`` (a GGUF file, a folder) will hold: its weights once loaded (the
    files' tensors as stored, or with ``dequantize`` every tensor's elements in float32) and the
    load's peak."""
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file():
        return _gguf_estimate(path, dequantize)
    return _safetensors_estimate(sorted(path.glob("*.safetensors")),
                                 json.loads((path / "config.json").read_text()), dequantize)


def estimate_weights(path: Path, dequantize: bool) -> int:
    """What loading ``path`` will hold in weights (:func:`estimate_load`)."""
    return estimate_load(path, dequantize).weights
