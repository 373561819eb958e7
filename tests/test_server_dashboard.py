"""The dashboard: rendered by the server, checked in headless Chromium, and its sign-in flow.

Chromium comes from Debian (`apt-get install -y chromium`). Without it this
test fails, unless CACHECTL_TEST_NO_CHROMIUM=1 says to skip it.
The screenshot lands in test-output/dashboard.png (gitignored).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from support.server_kit import MAIN, OTHER, LiveServer, bearer, fake_env, seed

from cachectl.index import NewEntry, open_index
from cachectl.index.models import utcnow
from cachectl.index.telemetry_queries import record_telemetry
from cachectl.telemetry import FunctionCounts, TelemetryBatch
from cachectl_server.app import create_app
from cachectl_server.auth import COOKIE_NAME
from cachectl_server.config import ServerSettings

OUTPUT = Path(__file__).resolve().parent.parent / "test-output"
# Read at import: the autouse isolated_home fixture clears CACHECTL_* before each test.
NO_CHROMIUM = os.environ.get("CACHECTL_TEST_NO_CHROMIUM") == "1"


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if NO_CHROMIUM:
        pytest.skip("Chromium not installed and CACHECTL_TEST_NO_CHROMIUM=1")
    pytest.fail(
        "Chromium is needed for the dashboard test: apt-get install -y chromium "
        "(or set CACHECTL_TEST_NO_CHROMIUM=1 to skip it)",
        pytrace=False,
    )


def chromium(url: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [
        chromium_binary(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={tmp / 'chromium-profile'}",
        *args,
        url,
    ]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


@pytest.fixture
def seeded(tmp_path):
    """Two caches with usage, a second environment, a week of hourly telemetry and growth."""
    s = seed(
        f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"), entries=6
    )
    index = open_index(s.db)
    index.update_cache(MAIN, max_size=40_000)
    env = index.find_environment(MAIN, s.digest)
    gpu = index.ensure_environment(MAIN, fake_env("0.9.1", "NVIDIA H100", 8))
    now = utcnow()
    index.upsert_entries(
        gpu.id,
        [
            NewEntry(
                key=f"jit_old-{n:064x}",
                module="jit_old",
                size=3000 + n,
                sha256="0" * 64,
                origin="warm",
                created_at=now - timedelta(days=6 - n),
            )
            for n in range(6)
        ],
    )
    for hours_ago in range(0, 30, 3):
        at = now - timedelta(hours=hours_ago)
        record_telemetry(
            index,
            env.id,
            TelemetryBatch(
                process=f"svc-{hours_ago}:1",
                cache=MAIN,
                environment_digest=s.digest,
                started_at=at,
                ended_at=at,
                functions={"jit_train": FunctionCounts(requests=20, hits=15 + hours_ago % 5)},
                hit_keys={},
                dropped=0,
            ),
        )
    index.close()
    return s


def test_dashboard_in_headless_chromium(seeded, tmp_path) -> None:
    s = seeded
    app = create_app(ServerSettings(db=s.db, dashboard_public=True))
    OUTPUT.mkdir(exist_ok=True)
    shot = OUTPUT / "dashboard.png"
    if shot.exists():
        shot.unlink()
    with LiveServer(app) as live:
        dom = chromium(f"{live.url}/", tmp_path, "--dump-dom", "--virtual-time-budget=5000")
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        result = chromium(
            f"{live.url}/", tmp_path, f"--screenshot={shot}", "--window-size=1280,1500"
        )
        assert result.returncode == 0, result.stderr[-2000:]
    # what the browser rendered: both caches, usage against the limit, both environments, the charts
    assert 'id="cache-main"' in html and 'id="cache-other"' in html
    assert "of 39.1 KiB limit" in html
    assert s.digest[:16] in html and "NVIDIA H100 x8" in html and "0.9.1" in html
    assert "85.0%" in html  # hit rate: sum of hits / requests over the seeded telemetry
    assert html.count("<svg") == 4 and "compile requests per hour" in html and "<rect" in html
    # no JavaScript, nothing fetched from anywhere else (the SVG namespace is a name, not a fetch)
    assert "<script" not in html and "<link" not in html and "@import" not in html
    assert "src=" not in html and 'href="http' not in html
    assert shot.exists() and shot.stat().st_size > 10_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dashboard_sign_in_with_a_cookie(seeded) -> None:
    s = seeded
    app = create_app(s.db)
    c = TestClient(app)
    page = c.get("/")
    assert page.status_code == 401 and 'action="/login"' in page.text
    bad = c.post("/login", data={"token": "cct_wrong"}, follow_redirects=False)
    assert bad.status_code == 401 and COOKIE_NAME not in bad.headers.get("set-cookie", "")
    ok = c.post("/login", data={"token": s.tokens["scoped_writer"]}, follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/"
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    page = c.get("/")
    assert (
        page.status_code == 200
        and 'id="cache-main"' in page.text
        and 'id="cache-other"' not in page.text
    )
    assert "scoped-writer" in page.text and s.tokens["scoped_writer"] not in page.text
    out = c.post("/logout", follow_redirects=False)
    assert out.status_code == 303
    c.cookies.clear()
    assert c.get("/").status_code == 401
    header = c.get("/", headers=bearer(s.tokens["reader"]))
    assert header.status_code == 200 and 'id="cache-other"' in header.text
    c.cookies.set(COOKIE_NAME, s.tokens["revoked"])
    assert c.get("/").status_code == 401
    assert OTHER  # both caches exist in the seed
