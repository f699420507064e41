"""Every vision family's test builds its tiny model folder and processor offline: nothing is
fetched from the Hugging Face Hub."""

from __future__ import annotations

import huggingface_hub
import pytest


@pytest.fixture(autouse=True)
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
