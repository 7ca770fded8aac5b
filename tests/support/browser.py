"""Headless Chromium, driven by selenium through Debian's chromium-driver, for the dashboard's test."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
SKIP_REASON = (
    "chromium or chromedriver not on PATH: install Debian's chromium and chromium-driver packages "
    "(.ci/run does)"
)

# Headless as root, and quiet: without the background-networking, component-update
# and sync switches Chromium keeps calling home, which a closed network refuses.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)


@contextlib.contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """A fresh headless Chromium with a new, empty profile, quit on exit."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        raise RuntimeError(SKIP_REASON)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        try:
            yield driver
        finally:
            driver.quit()
