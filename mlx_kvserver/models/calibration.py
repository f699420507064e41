"""The fixed text a model reads once when its pages are held in bits (``--kv-bits``): its keys'
offsets and channel weights are measured on it (``kv_cache.model.calibrate``,
``kv_cache.layout.key_shape``).

What a local chat server reads: a conversation in the model's own chat template, with prose,
code, a tool call and its result. NOTE: changing this text (or ``TOKENS``) changes every shaped
cache's fingerprint, so pages saved before are a clean miss afterwards; never edit it lightly.
"""

from __future__ import annotations

from .tokenizer import ChatTokenizer

TOKENS = 512  # at most this many tokens of the rendered text are read

SYSTEM = ("You are a helpful assistant running on the user's own computer. Answer clearly and "
          "briefly; when you change files, show the change.")

MESSAGES = [
    ("user", "Our nightly job keeps failing with `KeyError: 'timestamp'` when it reads the "
             "export. Here is the loader:\n\n```python\nimport csv\n\n\ndef load(path):\n"
             "    rows = []\n    with open(path, newline='') as f:\n"
             "        for row in csv.DictReader(f):\n"
             "            rows.append((row['timestamp'], float(row['value'])))\n"
             "    return sorted(rows)\n```\n\nThe file starts with `time,value,unit`. Why does "
             "it fail, and how would you fix it so that old exports still load?"),
    ("assistant", "The header names the column `time`, not `timestamp`, so `row['timestamp']` "
                  "raises. Read whichever name the file has:\n\n```python\nimport csv\n\n"
                  "NAMES = ('timestamp', 'time')\n\n\ndef load(path):\n    rows = []\n"
                  "    with open(path, newline='') as f:\n"
                  "        reader = csv.DictReader(f)\n"
                  "        key = next((n for n in NAMES if n in reader.fieldnames), None)\n"
                  "        if key is None:\n"
                  "            raise ValueError(f'{path}: no time column in {reader.fieldnames}')\n"
                  "        for row in reader:\n"
                  "            rows.append((row[key], float(row['value'])))\n"
                  "    return sorted(rows)\n```\n\nOld files keep working, and a file with "
                  "neither column now says so instead of failing deep inside the loop."),
    ("user", "Thanks. Can you check the weather in Lisbon for tomorrow before I book the "
             "flight? Then summarise the forecast in two sentences."),
    ("assistant", 'I will look it up.\n{"name": "get_weather", "arguments": {"city": "Lisbon", '
                  '"day": "tomorrow", "units": "metric"}}'),
    ("user", 'Tool result: {"city": "Lisbon", "day": "2026-05-14", "high_c": 24, "low_c": 16, '
             '"rain_probability": 0.1, "wind_kmh": 18, "summary": "sunny, light breeze"}'),
    ("assistant", "Tomorrow in Lisbon will be sunny with a light breeze, from 16 to 24 degrees "
                  "Celsius. Rain is unlikely (10%), so it is a good day to fly."),
    ("user", "Last question: explain in a short paragraph why the sky is blue, for a curious "
             "ten-year-old, and end with one fun fact about sunsets on Mars."),
]


def calibration_tokens(tokenizer: ChatTokenizer) -> list[int]:
    """The calibration text in ``tokenizer``'s chat template (its messages as plain paragraphs
    where the template will not render them), at most ``TOKENS`` tokens."""
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": r, "content": c} for r, c in MESSAGES]
    try:
        text = tokenizer.render(messages, add_generation_prompt=False)
    except Exception:  # a template that refuses these roles: the same text
        text = "\n\n".join(m["content"] for m in messages)
    return tokenizer.encode(text)[:TOKENS]
