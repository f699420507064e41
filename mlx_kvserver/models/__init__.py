"""Models: loading one (a folder, a GGUF file, a Hugging Face id: ``loading.py``, ``gguf.py``;
a vision-language model's folder through mlx-vlm: ``vision.py``),
what a load will hold (``footprint.py``), its chat tokenizer (``tokenizer.py``), the registry of
served models and their aliases (``registry.py``), the models requests load and unload on
demand (``on_demand.py``: which and where from; ``serving.py``: the loading and unloading), and
writing a loaded model as an MLX folder (``convert.py``).
"""
