"""Models: loading one (a folder, a GGUF file, a Hugging Face id: ``loading.py``, ``gguf.py``),
its chat tokenizer (``tokenizer.py``), the registry of served models and their aliases
(``registry.py``), and writing a loaded model as an MLX folder (``convert.py``).
"""
