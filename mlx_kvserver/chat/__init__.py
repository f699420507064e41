"""The one conversation model every API translates into (``conversation.py``), the engine's events
(``output.py``), rendering through the model's template and tokenizing (``render.py``,
``encode.py``), each model family's formats (``formats.py``) and how its output is read as it
streams (``parse.py``, ``harmony.py``, the call readers), and output grammars
(``constraints.py``).
"""
