"""The dashboard's routes through the real app: login with the token sets a cookie that
reads the API, pages carry a strict CSP, ETags turn an unchanged poll into a 304, and the
history route answers the rings."""

from __future__ import annotations

from fastapi.testclient import TestClient

from fleetserve.api.app import create_app
from fleetserve.api.auth import SESSION_COOKIE
from fleetserve.controller.controller import Controller
from fleetserve.controller.history import History
from tests.unit.api.conftest import TOKEN


def browser(ctl: Controller) -> TestClient:
    """A client with no Authorization header, as a browser is."""
    return TestClient(create_app(ctl, token=TOKEN), base_url="http://127.0.0.1")


def test_without_a_session_the_dashboard_sends_to_the_login_page(ctl: Controller) -> None:
    c = browser(ctl)
    r = c.get("/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    login = c.get("/login")
    assert login.status_code == 200 and 'id="login-form"' in login.text
    assert "script-src 'self'" in login.headers["content-security-policy"]
    assert login.headers["x-frame-options"] == "DENY"
    assert c.get("/api/v1/services").status_code == 401


def test_login_sets_a_cookie_that_reads_but_never_writes(ctl: Controller) -> None:
    app = create_app(ctl, token=TOKEN)
    c = TestClient(app, base_url="http://127.0.0.1")
    bad = c.post("/ui/login", json={"token": "nope"})
    assert bad.status_code == 401 and SESSION_COOKIE not in bad.cookies
    r = c.post("/ui/login", json={"token": TOKEN})
    assert r.status_code == 200
    set_cookie = r.headers["set-cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie and TOKEN not in set_cookie
    page = c.get("/")
    assert page.status_code == 200 and "/ui/static/dashboard.js" in page.text
    assert c.get("/api/v1/services").json() == []
    assert c.post("/api/v1/services", json={"yaml": "run: x"}).status_code == 401
    kept = c.cookies[SESSION_COOKIE]
    c.post("/ui/logout", json={})
    assert c.get("/api/v1/services").status_code == 401
    # a copy of the cookie kept from before the logout is worth nothing either
    stale = TestClient(app, base_url="http://127.0.0.1")  # the same controller
    stale.cookies.set(SESSION_COOKIE, kept)
    assert stale.get("/api/v1/services").status_code == 401


def test_static_files_are_a_fixed_list(ctl: Controller) -> None:
    c = browser(ctl)
    js = c.get("/ui/static/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert c.get("/ui/static/charts.js").status_code == 200
    for name in ("index.html", "..%2Fauth.py", "nope.js", "%2e%2e%2fdashboard.py"):
        assert c.get(f"/ui/static/{name}").status_code in (401, 404)


def test_an_unchanged_poll_is_a_304(ctl: Controller) -> None:
    c = TestClient(
        create_app(ctl, token=TOKEN),
        base_url="http://127.0.0.1",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    first = c.get("/api/v1/services")
    tag = first.headers["etag"]
    again = c.get("/api/v1/services", headers={"If-None-Match": tag})
    assert again.status_code == 304 and again.content == b""
    ctl.store.create_service("web", "y", "{}", 1.0)
    changed = c.get("/api/v1/services/web/events", headers={"If-None-Match": tag})
    assert changed.status_code == 200 and changed.headers["etag"] != tag
    assert "etag" not in c.get("/api/v1/services/nope").headers  # errors are not tagged


def test_history_route(ctl: Controller) -> None:
    c = TestClient(
        create_app(ctl, token=TOKEN),
        base_url="http://127.0.0.1",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    ctl.store.create_service("web", "y", "{}", 1.0)
    empty = c.get("/api/v1/services/web/history").json()
    assert empty["points"] == [] and empty["replicas"] == {}
    h = History(step=1.0)
    for t in range(3):
        h.observe(100.0 + t, None, 1, 2, {})
    ctl.history_of = lambda name: h  # type: ignore[method-assign]
    body = c.get("/api/v1/services/web/history").json()
    assert [p["at"] for p in body["points"]] == [100.0, 101.0, 102.0]
    assert body["points"][0]["target"] == 2 and body["points"][0]["rps"] is None
    later = c.get("/api/v1/services/web/history", params={"after": 100.5}).json()
    assert [p["at"] for p in later["points"]] == [101.0, 102.0]
    assert c.get("/api/v1/services/web/history", params={"after": -1}).status_code == 422
    assert c.get("/api/v1/services/nope/history").status_code == 404


def test_no_page_of_the_controller_loads_code_from_another_origin(ctl: Controller) -> None:
    """FastAPI's /docs and /redoc load Swagger UI and ReDoc from a CDN (unpinned, no
    integrity check) into the origin where the dashboard's session cookie is valid: they are
    not served, neither with the session cookie nor with the token; the schema is."""
    app = create_app(ctl, token=TOKEN)
    c = TestClient(app, base_url="http://127.0.0.1")
    assert c.post("/ui/login", json={"token": TOKEN}).status_code == 200
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        for headers in ({}, bearer):
            r = c.get(path, headers=headers)
            assert r.status_code == 404, (path, r.status_code)
            assert "cdn" not in r.text.lower()
    assert "paths" in c.get("/openapi.json", headers=bearer).json()
    for page in ("/", "/login"):
        text = c.get(page).text
        assert "https://" not in text and "http://" not in text, page
