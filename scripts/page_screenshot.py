"""A screenshot of the chat page (docs/chat-page.png) on the real default model.

Starts the server as a subprocess on loopback with a fresh cache directory (as benchmarks/ttft.py
does), opens the page in headless Chromium (Debian's chromium + chromium-driver, through
selenium), has a short conversation (each turn after the first comes from the cache), opens
the cache panel and saves the screenshot.
Usage: .venv/bin/python -m scripts.page_screenshot [--out docs/chat-page.png]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.ttft import Server, free_port
from harness.browser_utils import MISSING, find_chromium, quit_chromium, start_chromium

ROOT = Path(__file__).resolve().parent.parent

QUESTIONS = ["What is the capital of France? Answer in one sentence.",
             "List three famous landmarks in Paris.",
             "Write a Python function that returns the square of a number. Use a code block."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "chat-page.png"))
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-tokens", type=int, default=80)
    args = ap.parse_args()
    found = find_chromium()
    if found is None:
        print(MISSING, file=sys.stderr)
        return 1
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = Server(Path(tempfile.mkdtemp(prefix="page-shot-")) / "kv", free_port(),
                    ["--model", args.model, "--max-tokens", str(args.max_tokens)])
    root = server.url.removesuffix("/v1")
    web = None
    try:
        web = start_chromium(*found, size=(1440, 980))
        wait = WebDriverWait(web, 600)
        web.get(root + "/")
        wait.until(lambda w: w.execute_script("return document.body.dataset.ready") == "1")
        for n, question in enumerate(QUESTIONS, 1):
            web.find_element(By.ID, "input").send_keys(question)
            web.find_element(By.ID, "send").click()
            wait.until(lambda w: w.find_element(By.ID, "main").get_attribute("data-answers")
                       == str(n) and w.find_element(By.ID, "main").get_attribute("data-state")
                       == "idle")
        web.find_element(By.ID, "toggle-cache").click()
        wait.until(lambda w: w.find_elements(By.CSS_SELECTOR, ".cache-entry"))
        time.sleep(0.5)
        web.save_screenshot(args.out)
        print(f"saved {args.out}")
        for stats in web.find_elements(By.CSS_SELECTOR, ".msg-stats"):
            print(" ", stats.text)
    finally:
        if web is not None:
            quit_chromium(web)
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
