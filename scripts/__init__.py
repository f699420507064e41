"""Set-up, serving and tools: ``setup.sh``, ``serve.sh``, ``test.sh``, and Python tools run from
the repository root (``.venv/bin/python -m scripts.<name>``; those importing only the installed
packages also as ``.venv/bin/python scripts/<name>.py``). The benchmarks are in ``benchmarks/``.
"""
