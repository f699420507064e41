"""What the tests and the benchmarks run against, shared by ``tests/``, ``benchmarks/`` and
``scripts/`` (the harness imports none of them):

- tiny random-weight models and their folders, no network (``tiny_model``: a llama;
  ``tiny_families``: one per model family mlx-lm runs);
- the real server, in-process on a thread (``server_utils``) or as a process of its own that
  dies by a real SIGKILL (``server_procs``);
- headless Chromium for the chat page (``browser_utils``);
- a ``redis-server`` on its own port and folder, nothing persisted (``redis_proc``);
- coding-agent sessions in the three API shapes agents speak (``agent_sessions``), with their
  25 tools (``agent_tools``);
- the machine's services a run requires or may skip (``services``).
"""
