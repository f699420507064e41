"""The engine: one thread that owns the models and their caches (``engine.py``), a scheduler per
model that decides each step (``scheduler.py``) and the step that runs its plan (``step.py``:
the forward passes of ``runner.py``), the memory policy (``pressure.py``, over the budget of
``memory.py``), speculative decoding (``speculation/``), each request's state and choices
(``request.py``), sampling, the next turn prepared while idle (``prepare.py``) and why a turn
re-read tokens (``divergence.py``). It takes the one conversation model (``chat/``) and never an
HTTP type.
"""
