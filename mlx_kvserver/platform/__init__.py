"""The machine: a fast BLAS for MLX's CPU backend on Linux, chosen per machine and proven in a child
process before use (``blas.py``, its candidates and probe), and reading shared objects' symbols
(``elf.py``). Nothing of the server; the CLI and the scripts call it before MLX loads.
"""
