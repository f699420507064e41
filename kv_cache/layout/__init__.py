"""The cache's description, below the pages: kinds of layer (``kinds.py``), a model's cache spec and
its groups' page geometry (``spec.py``) and the page codec for pages in bits (``quant.py``).
"""
