"""The machine: a fast BLAS for MLX's CPU backend on Linux, chosen per machine and proven in a child
process before use (``blas.py``, its candidates and probe), reading shared objects' symbols
(``elf.py``), the machine's memory as the server's budget needs it (``memory_facts.py``), and
the C allocator's free pages handed back to the system (``heap.py``).
Nothing of the server; the CLI and the scripts call the BLAS's part before MLX loads.
"""
