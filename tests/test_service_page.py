"""The live node page in a real headless Chromium (Debian's package), with a screenshot check.

Skips with its reason where no Chromium is installed (``apt-get install -y
chromium``).  The page is served by a real ``krex service`` against a real
daemon; the browser runs its script, which polls ``/v1/node/summary``.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from helpers import run_krex, wait_for

pytest.importorskip("fastapi", reason="the `server` extra is not installed")
from service_support import Service

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium (apt-get install -y "
                                                        "chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1100,900", "--virtual-time-budget=4000"]
HELD = (0x2F, 0x7E, 0xD8)  # the page's colour of a held region
NOT_CLEAN = (0xB0, 0x00, 0x20)  # ... of a held region that was not clean


def browse(tmp_path, url: str, *what: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    return subprocess.run([str(BROWSER), *FLAGS, f"--user-data-dir={profile}", *what, url],
                          capture_output=True, text=True, timeout=120)


def held_pixels(png) -> int:
    """Pixels of a held region's colours: clean or not (on a loaded machine a region may
    be not clean from contention alone, and is then drawn in the other colour)."""
    from PIL import Image

    with Image.open(png) as im:
        rgb = im.convert("RGB")
        return sum(1 for x in range(rgb.width) for y in range(rgb.height)
                   if rgb.getpixel((x, y)) in (HELD, NOT_CLEAN))


def timeline_shows(s: Service, label: str, count: int) -> bool:
    """The service's watcher has polled the daemon since ``count`` regions ``label`` ended
    (it polls every second; a browser that loads the page before that draws none)."""
    status, summary = s.call("GET", "/v1/node/summary?seconds=300")
    assert status == 200, summary
    return sum(r.get("label") == label for r in summary["timeline"]) >= count


def test_node_page_shows_devices_and_draws_regions(daemon, tmp_path):
    s = Service(tmp_path / "state", "--runners", "1")
    page = f"{s.base}/#token={s.token}"  # the page sends the fragment's token
    try:
        before = tmp_path / "before.png"
        assert browse(tmp_path, page, f"--screenshot={before}").returncode == 0
        prog = ("import krex\nfor _ in range(5):\n    with krex.region(label='page'):\n"
                "        pass\n")
        _, job = s.call("POST", "/v1/jobs/exec", {"program": prog})
        assert s.wait(job["id"])["state"] == "succeeded"
        assert run_krex("region", "--", "true").returncode == 0
        wait_for(lambda: timeline_shows(s, "page", 5), timeout_s=30, interval_s=0.2)
        dom = browse(tmp_path, page, "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert "daemon up" in dom.stdout, dom.stdout[-3000:]  # the script ran and fetched
        assert "<td>cpu</td>" in dom.stdout and "<rect" in dom.stdout
        assert "<td>local</td>" in dom.stdout  # the tenants' share table
        after = tmp_path / "after.png"
        assert browse(tmp_path, page, f"--screenshot={after}").returncode == 0
    finally:
        s.stop()
    # The legend has a small swatch of each held colour; regions add bars of them.
    # Negative control: the page before any region shows the swatches only.
    legend, drawn = held_pixels(before), held_pixels(after)
    assert 0 < legend < 400, legend
    assert drawn > legend + 150, (legend, drawn)
