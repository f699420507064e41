"""The engine: one thread that owns the models and their caches (``engine.py``), a scheduler per
model that batches requests step by step (``scheduler.py``), the forward passes (``runner.py``),
each request's state and choices (``request.py``), sampling, the next turn prepared while idle
(``prepare.py``) and why a turn re-read tokens (``divergence.py``). It takes the one
conversation model (``chat/``) and never an HTTP type.
"""
