"""The nginx config renderer, and the gunicorn settings that must agree with it."""

from __future__ import annotations

import os
import re
import string
import subprocess
import sys

import pytest

from scripts.deploy.render_nginx import (
    PROXY_TIMEOUT_MARGIN_S,
    TEMPLATE,
    Options,
    gunicorn_keepalive,
    in_flight_per_backend,
    render,
)
from service.config.settings import Settings
from service.errors import SettingsError
from service.http.access import request_id
from service.topology.inventory import Inventory
from tests.support.server import ROOT

KEEPALIVE = gunicorn_keepalive()


def rendered(options: Options | None = None, settings: Settings | None = None) -> str:
    options = options or Options(prefix="/srv/nginx")
    return render(TEMPLATE.read_text(), options, settings or Settings(), KEEPALIVE)


def directive(text: str, name: str) -> list[str]:
    """The arguments of every ``name ...;`` directive in ``text``."""
    return re.findall(rf"^[ \t]*{name}[ \t]+([^;\n]*);", text, flags=re.MULTILINE)


def test_every_placeholder_is_filled() -> None:
    assert "{{" not in rendered()


def test_limits_follow_the_services_settings() -> None:
    text = rendered(settings=Settings(max_body_bytes=2_000_000, request_timeout_ms=12_500))
    assert directive(text, "client_max_body_size") == ["2000000"]
    # nginx waits longer than the service's own deadline, so the service's 504 arrives first.
    assert directive(text, "proxy_read_timeout") == [f"{13 + PROXY_TIMEOUT_MARGIN_S}s"]
    assert directive(text, "proxy_send_timeout") == [f"{13 + PROXY_TIMEOUT_MARGIN_S}s"]
    assert directive(text, "proxy_next_upstream_timeout") == ["13s"]
    assert "over 2000000 bytes (SERVE_MAX_BODY_BYTES)" in text


def test_several_backends_share_load_with_passive_health_and_bounded_retries() -> None:
    backends = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "unix:/run/serve.sock")
    options = Options(prefix="/srv/nginx", backends=backends, max_fails=2, fail_timeout_s=7, max_in_flight=50)
    text = rendered(options)
    assert directive(text, "server") == [f"{b} max_fails=2 fail_timeout=7s max_conns=50" for b in backends]
    assert re.search(r"^\s*least_conn;", text, flags=re.MULTILINE)
    assert directive(text, "proxy_next_upstream") == ["error timeout http_502 http_503 non_idempotent"]
    assert directive(text, "proxy_next_upstream_tries") == ["3"]
    two = rendered(Options(prefix="/p", backends=backends[:2]))
    assert directive(two, "proxy_next_upstream_tries") == ["2"]


def test_upstream_keepalive_is_http11_and_idles_out_before_gunicorn_does() -> None:
    text = rendered()
    assert directive(text, "proxy_http_version") == ["1.1"]
    assert directive(text, "proxy_set_header Connection") == ['""']
    (idle,) = directive(text, "keepalive_timeout")
    assert int(idle.removesuffix("s")) < KEEPALIVE


def test_forwarding_headers_request_id_and_error_pages() -> None:
    text = rendered(Options(prefix="/p", metrics_allow=("10.9.0.0/16", "127.0.0.1")))
    assert directive(text, "proxy_set_header X-Forwarded-For") == ["$proxy_add_x_forwarded_for"]
    assert directive(text, "proxy_set_header X-Forwarded-Proto") == ["$scheme"]
    assert directive(text, "proxy_set_header X-Request-ID") == ["$serve_request_id"]
    # In the form service.http.arrival reads, replacing any a client sent.
    assert directive(text, "proxy_set_header X-Request-Start") == ['"t=${msec}"']
    assert directive(text, "server_tokens") == ["off"]
    assert directive(text, "allow") == ["10.9.0.0/16", "127.0.0.1"]
    for status in (413, 502, 503, 504):
        # 502's page answers with its own status: 503 when no backend had room.
        assert re.search(rf"error_page {status} (= )?@\w+;", text)
        assert re.search(rf"return {status} '\{{\"error\":", text)


def test_nginx_passes_on_exactly_the_request_ids_the_service_keeps() -> None:
    # The map's regex, run here by Python's re: for a bracket class and a
    # count, PCRE (nginx's) and re agree.
    [pattern] = re.findall(r'^\s*"~\^(.*)\$"\s+\$http_x_request_id;', rendered(), flags=re.MULTILINE)
    nginx_keeps = re.compile(pattern)
    candidates = [*string.printable, "\u00e9", "a" * 128, "a" * 129, "", "trace/abc+def==", "two words"]
    for rid in candidates:
        service_keeps = request_id(rid) == rid
        assert bool(nginx_keeps.fullmatch(rid)) == service_keeps, repr(rid)
    assert nginx_keeps.fullmatch("span/0Af+x=_.:-")


def test_requests_at_each_backend_are_bounded_at_a_full_batch_per_worker_and_a_few_more() -> None:
    two = ("10.0.0.1:8000", "10.0.0.2:8000")
    four_cores = Inventory(affinity_cores=4)
    # As the service plans this host: 4 workers, each taking max batch size + 8 at once.
    assert in_flight_per_backend(Settings(max_batch_size=32), four_cores) == 4 * 40
    assert in_flight_per_backend(Settings(torch_threads=2), four_cores) == 2 * 72
    assert in_flight_per_backend(Settings(workers=3, threads=10), four_cores) == 30
    assert in_flight_per_backend(Settings(workers=3, worker_class="gevent"), four_cores) == 3 * 72
    assert in_flight_per_backend(Settings(workers=3, worker_class="sync"), four_cores) == 3
    # Per backend, counted by nginx's workers together (a shared zone).
    text = rendered(Options(prefix="/p", backends=two, max_in_flight=100))
    assert [line.rsplit(" ", 1)[1] for line in directive(text, "server")] == ["max_conns=100"] * 2
    assert directive(text, "zone") == ["serve_upstream 64k"]
    assert "every backend has 100 requests in flight" in text
    planned = in_flight_per_backend(Settings())
    assert directive(rendered(), "server") == [
        f"127.0.0.1:8000 max_fails=3 fail_timeout=10s max_conns={planned}"
    ]
    # nginx's own busy 503s are held about a second, as the service holds its refusals.
    assert directive(text, "limit_rate") == ["200"] * 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (Options(prefix="/p", backends=()), "at least one --backend"),
        (Options(prefix="/p", backends=("10.0.0.1",)), "--backend must be HOST:PORT or unix:PATH"),
        (Options(prefix="/p", backends=("a b:80",)), "--backend must be"),
        (Options(prefix="/p", listen="127.0.0.1:http"), "--listen must be PORT, HOST:PORT or unix:PATH"),
        (Options(prefix="/p", metrics_allow=("monitoring",)), "--metrics-allow must be an IP address"),
        (Options(prefix="/p; evil"), "--prefix must not be empty or hold spaces"),
        (Options(prefix="/p", upstream_keepalive_timeout_s=KEEPALIVE), "below gunicorn's keepalive"),
        (Options(prefix="/p", max_fails=0), "--max-fails must be a positive integer, got 0"),
        (Options(prefix="/p", next_upstream_tries=0), "--next-upstream-tries must be a positive integer"),
        (Options(prefix="/p", max_in_flight=0), "--max-in-flight must be a positive integer, got 0"),
    ],
)
def test_bad_options_are_refused_with_a_reason(options: Options, message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        rendered(options)


def test_gunicorn_conf_trusts_the_configured_proxies() -> None:
    # gunicorn_conf.py is the master's config: load it in a fresh process, as gunicorn does.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    env["SERVE_FORWARDED_ALLOW_IPS"] = "10.1.0.0/16,10.2.0.5"
    probe = "import gunicorn_conf as c; print(c.forwarded_allow_ips, c.keepalive)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["10.1.0.0/16,10.2.0.5", str(KEEPALIVE)]


def test_no_room_is_read_from_the_upstream_group_named_last() -> None:
    # The map's regex, run here by Python's re (PCRE and re agree on this one).
    [pattern] = re.findall(r'"~(.+)" 1;', rendered().split("$serve_no_room {", 1)[1].split("}", 1)[0])
    # nginx names the group when it found no backend with room, after any it tried first.
    for no_room in ("serve", "10.0.0.1:8000, serve", "10.0.0.1:8000, unix:/run/g.sock, serve"):
        assert re.search(pattern, no_room)
    for answered in ("10.0.0.1:8000", "10.0.0.1:8000, 10.0.0.2:8000", "unix:/run/serve", "serve.local:80"):
        assert not re.search(pattern, answered)
