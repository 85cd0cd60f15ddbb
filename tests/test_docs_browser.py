"""``/docs`` in a real browser with every outside host unreachable: Swagger UI renders the API from this server's own
files (the operations list is in the page, the screenshot is not blank). Needs a headless Chromium (Debian's
``chromium-headless-shell`` or ``chromium``; docs/testing.md); skipped where there is none."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_server import Live, wait_ready

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="module")
def chromium() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        pytest.skip("no headless Chromium here: apt-get install chromium-headless-shell (docs/testing.md)")
    return found


def offline(binary: str, tmp: Path) -> list[str]:
    """The browser's command with no way out but to this machine: every host name but 127.0.0.1 fails to resolve,
    and anything else goes to a proxy on a closed port."""
    return [binary, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp}",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--proxy-server=http://127.0.0.1:9",
            "--proxy-bypass-list=127.0.0.1", "--window-size=1280,1600", "--virtual-time-budget=10000"]


@pytest.fixture(scope="module")
def live(chromium) -> Iterator[Live]:
    server = Live(DEMO, engine=dict(kv_cache_memory="4MiB"), wait=False)
    wait_ready(server.base, timeout=600)
    yield server
    server.stop()


def test_docs_render_swagger_ui_with_the_network_off(chromium, live, tmp_path):
    cmd = offline(chromium, tmp_path / "profile")
    outside = subprocess.run(cmd + ["--dump-dom", "http://example.com/"], capture_output=True, text=True, timeout=120)
    assert "Example Domain" not in outside.stdout  # the outside is indeed unreachable
    dom = subprocess.run(cmd + ["--dump-dom", live.base + "/docs"], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    paths = httpx.get(live.base + "/openapi.json", timeout=10).json()["paths"]
    operations = sum(len(item) for item in paths.values())
    assert dom.stdout.count('class="opblock opblock-') == operations  # Swagger UI drew every operation
    for path in paths:
        assert f'data-path="{path}"' in dom.stdout, path
    assert "Failed to load API definition" not in dom.stdout
    shot = tmp_path / "docs.png"
    run = subprocess.run(cmd + [f"--screenshot={shot}", live.base + "/docs"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (1600, 1280)
    coloured = (abs(pixels - pixels[0, 0]).sum(axis=-1) > 0.1).mean()
    assert 0.05 < coloured < 0.95 and pixels.std() > 0.05  # drawn, neither blank nor one colour
