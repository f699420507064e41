"""What people use to talk to the server: the terminal REPL (``repl.py``, its HTTP client and
rendering, the cache stats table) and the chat page's files (``page/``: HTML, CSS and JavaScript,
served by ``api/page.py``).
"""
