"""The served OpenAPI description against the server, checked by schemathesis as a user runs it
(``schemathesis run http://HOST/openapi.json --checks all``): no 5xx, no undeclared status, no
body the description calls invalid accepted (ST201) and none it calls valid refused (ST202).

The description states some rules in words, because JSON Schema cannot (tool results answer
earlier calls, a named tool is one of the tools, token ids are below the vocabulary size): the
hooks (tests/api/schemathesis_hooks.py) make the bodies schemathesis generates as valid keep
them, and change nothing else; a refusal for a prompt longer than the model's context is not a
mismatch. The KV-cache import is left out: its body is a file that only the
export gives, of a media type schemathesis cannot make up (tests/api/test_openapi_bodies.py
follows the description's link from the export to it instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("schemathesis")
EXAMPLES = 5  # per operation and phase; the coverage phase draws ~2,800 cases besides
SEED = 54


@pytest.mark.timeout(600)
def test_schemathesis_finds_no_mismatch_between_the_description_and_the_server(
        tiny_lm, tmp_path):
    config = ServerConfig(max_tokens=4, page_size=8, kv_cache_dir=tmp_path / "kv")
    report = tmp_path / "report.json"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.api.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with running_server([tiny_lm], config) as url:
        spec = httpx.get(url.removesuffix("/v1") + "/openapi.json").json()
        run = subprocess.run(
            [str(CLI), "run", url.removesuffix("/v1") + "/openapi.json", "--checks", "all",
             "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--workers", "1",
             "--exclude-path", "/v1/kv_cache/import", "--generation-database", "none",
             "--no-color", "--report", "json", "--report-json-path", str(report)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    out = json.loads(report.read_text())
    print(f"\nschemathesis: {out['test_cases']}, dropped by the hooks' filter_failure (a "
          f"prompt over the context): {out['filtered']}\n{run.stdout[run.stdout.find('SUMMARY'):]}")
    heads = [run.stdout.find(f"= {h} =") for h in ("ERRORS", "FAILURES")]
    why = run.stdout[min([i for i in heads if i >= 0], default=0):][:12000] + run.stderr[-2000:]
    assert run.returncode == 0 and out["complete"], why
    assert not out["failures"] and not out["errors"], why
    # every operation the description has was tested, but the excluded import and the
    # description's own route (schemathesis leaves out the document it reads)
    methods = {"get", "put", "post", "delete", "patch", "head", "options"}
    described = sum(len(methods & set(ops)) for path, ops in spec["paths"].items()
                    if path not in ("/v1/kv_cache/import", "/openapi.json"))
    assert out["operations"]["tested"] == out["operations"]["selected"] == described >= 16
    assert out["test_cases"]["generated"] >= 1000
