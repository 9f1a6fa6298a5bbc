"""The dashboard's files (src/fedlang/deploy/server/dashboard.py): served with a strict
content-security policy, uPlot's checked files beside them, nothing inline that such a
policy would block. The page itself is tested in Chromium: tests/deploy/browser/
test_dashboard.py."""

import hashlib
import html.parser

import httpx
import pytest

from fedlang.deploy import assets
from fedlang.deploy.server import dashboard


class _Inline(html.parser.HTMLParser):
    """What of a page a `script-src 'self'; style-src 'self'` policy would block."""

    def __init__(self):
        super().__init__()
        self.blocked, self.scripts, self.in_script = [], [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.blocked += [f"{tag} {name}" for name in attrs if name.startswith("on") or name == "style"]
        if tag == "style":
            self.blocked.append("<style>")
        if tag == "script":
            self.in_script = True
            self.scripts.append(attrs.get("src"))

    def handle_endtag(self, tag):
        self.in_script = self.in_script and tag != "script"

    def handle_data(self, data):
        if self.in_script and data.strip():
            self.blocked.append("an inline <script>")


def test_the_page_is_served_with_a_strict_policy_and_nothing_inline(server_factory):
    server = server_factory()
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/dashboard").headers["location"].endswith("/dashboard/")
        page = http.get("/dashboard/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy
        assert "unsafe" not in policy and page.headers["x-frame-options"] == "DENY"
        parsed = _Inline()
        parsed.feed(page.text)
        assert parsed.blocked == [] and parsed.scripts == ["dashboard.js"]
        for name in ("dashboard.js", "charts.js"):
            module = http.get(f"/dashboard/{name}")
            assert module.headers["content-type"] == "text/javascript"
            assert module.headers["content-security-policy"] == policy
        assert http.get("/dashboard/dashboard.css").headers["content-type"] == "text/css"
        # the page holds no data: the API it reads wants the admin token
        assert http.get("/v1/admin/populations").status_code == 401


def test_uplot_is_served_from_its_checked_files(server_factory):
    if assets.UPLOT.missing():
        pytest.skip(f"uPlot's files {assets.UPLOT.missing()} are missing; `python -m "
                    "fedlang.deploy.assets` (run by scripts/browser_setup.sh) fetches them")
    server = server_factory()
    with httpx.Client(base_url=server.url) as http:
        module = http.get("/dashboard/uplot/uPlot.esm.js")
        assert module.headers["content-type"] == "text/javascript"
        assert hashlib.sha256(module.content).hexdigest() == assets.UPLOT.files["dist/uPlot.esm.js"]
        assert http.get("/dashboard/uplot/LICENSE").text.startswith("The MIT License")


def test_without_uplot_the_page_is_served_and_the_charts_are_not(server_factory, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("FEDLANG_UPLOT_DIR", str(tmp_path / "empty"))
    assert dashboard.missing() == list(assets.UPLOT.stored)
    server = server_factory()
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/dashboard/").status_code == 200
        assert http.get("/dashboard/uplot/uPlot.esm.js").status_code == 404


def test_a_server_may_leave_the_dashboard_out(server_factory):
    server = server_factory(dashboard=False)
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/dashboard/").status_code == 404
