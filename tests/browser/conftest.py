"""Fixtures for the real-browser tests (marker `browser`): Debian chromium driven by Playwright.

- `browser` (session): a headless chromium `playwright.sync_api.Browser`.
- `page`: a fresh page in a fresh context per test. Requests to hosts other than
  127.0.0.1/localhost are aborted and recorded, so tests prove offline operation.
- `page_log`: the `PageLog` of that page (blocked_urls, console_errors, page_errors).
- `screenshot(name, target=None, *, full_page=True)`: saves a PNG (of the page, or of a
  Locator) under the test's artifact folder and returns its path.
- `artifacts_dir`: $CKPTLAB_ARTIFACTS, else <repo>/.artifacts/browser/ (git-ignored).
A failing test that used `page` also leaves FAILED-<phase>.png and FAILED-<phase>.log there.
`serve_process` and `free_port` live in browser_support.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from browser_support import (
    CHROMIUM_ARGS,
    CHROMIUM_MISSING,
    REPO,
    PageLog,
    chromium_executable,
    open_offline_page,
)

BROWSER_TIMEOUT_MS = 30_000  # default timeout of every Playwright action and wait


def _unavailable(reason: str) -> None:
    """Under CI a missing browser is a failure (CI must run these tests); elsewhere a skip."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in this folder is a `browser` test, marked or not."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.browser)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    path = Path(os.environ.get("CKPTLAB_ARTIFACTS") or REPO / ".artifacts" / "browser")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _test_dir(artifacts_dir: Path, node: pytest.Item) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", node.nodeid.removeprefix("tests/browser/"))
    path = artifacts_dir / name.strip("_")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def browser():
    """Headless Debian chromium. Playwright's `launch` gives it a fresh temporary user-data
    dir (deleted on close); each test gets its own context from `page`."""
    executable = chromium_executable()
    if executable is None:
        override = os.environ.get("CKPTLAB_CHROMIUM")
        _unavailable(f"CKPTLAB_CHROMIUM={override!r} is not an executable" if override
                     else CHROMIUM_MISSING)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed: pip install -c constraints.txt -e '.[dev]'")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=executable, headless=True, args=list(CHROMIUM_ARGS),
            timeout=BROWSER_TIMEOUT_MS,
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page_log() -> PageLog:
    return PageLog()


@pytest.fixture
def page(browser, page_log: PageLog, request: pytest.FixtureRequest, artifacts_dir: Path):
    """A fresh page (own context, 1280x900) that cannot reach anything but this machine."""
    page = open_offline_page(browser, page_log, timeout_ms=BROWSER_TIMEOUT_MS)
    try:
        yield page
    finally:
        for when in ("setup", "call"):
            report = getattr(request.node, f"rep_{when}", None)
            if report is not None and report.failed:
                out = _test_dir(artifacts_dir, request.node)
                try:
                    page.screenshot(path=out / f"FAILED-{when}.png", full_page=True,
                                    timeout=10_000)
                except Exception as exc:  # a crashed page must not hide the real failure
                    (out / f"FAILED-{when}.screenshot-error.txt").write_text(repr(exc))
                (out / f"FAILED-{when}.log").write_text(page_log.summary())
        page.context.close()


@pytest.fixture
def screenshot(request: pytest.FixtureRequest, artifacts_dir: Path) -> Callable[..., Path]:
    """screenshot(name, target=None, *, full_page=True) -> Path of <artifacts>/<test>/<name>.png.
    `target` is a Page or a Locator (an element shot); it defaults to the test's `page`."""

    def take(name: str, target=None, *, full_page: bool = True) -> Path:
        if target is None:
            target = request.getfixturevalue("page")
        path = _test_dir(artifacts_dir, request.node) / f"{name}.png"
        if hasattr(target, "set_viewport_size"):  # a Page
            target.screenshot(path=path, full_page=full_page)
        else:  # a Locator or ElementHandle
            target.screenshot(path=path)
        return path

    return take
