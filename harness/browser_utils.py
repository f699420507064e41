"""Headless Chromium through selenium, pointed at the system's browser and driver (Debian's
``chromium`` and ``chromium-driver``). The driver path is given explicitly, so selenium never
starts Selenium Manager (nothing is downloaded)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)
# NOTE: without the background-networking flags Chromium keeps trying to reach Google's hosts,
# which a machine without network refuses many times a second.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--disable-extensions", "--disable-default-apps")


def find_chromium() -> tuple[str, str] | None:
    """(browser, driver) paths, or None when either is missing."""
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = next((p for p in map(shutil.which, DRIVERS) if p), None)
    return (browser, driver) if browser and driver else None


MISSING = ("the browser test did not run: no Chromium and ChromeDriver on this machine "
           "(Debian: apt-get install chromium chromium-driver; .ci/run installs them)")


def start_chromium(browser: str, driver: str, downloads: Path | None = None,
                   size: tuple[int, int] = (1280, 860)):
    """A selenium WebDriver on a fresh profile; the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}"):
        options.add_argument(flag)
    if downloads is not None:
        options.add_experimental_option("prefs", {
            "download.default_directory": str(downloads), "download.prompt_for_download": False,
            "safebrowsing.enabled": False})
    web = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    web.set_script_timeout(60)
    web.profile_dir = profile  # removed by quit_chromium
    return web


def quit_chromium(web) -> None:
    try:
        web.quit()
    finally:
        shutil.rmtree(web.profile_dir, ignore_errors=True)
