"""Never a traceback, never a secret: the CLI's one guard around every command, and redaction of what
third-party code says (a mirror echoing the Authorization header in a 200 answer, credentials in
HF_ENDPOINT and proxy URLs)."""

from __future__ import annotations

import base64
import subprocess
import sys

import pytest

import surgeon.api
from surgeon.text.redact import redact

from helpers.hub import TOKEN, Surgeon, closed_port_url, make_source
from helpers.hub_server import HubServer

ENDPOINT_PASSWORD = "MirrorPw-4242"
PROXY_PASSWORD = "ProxyPw-9999"


def _assert_no_secret(*texts: str, also: str = "never") -> None:
    for text in texts:
        for secret in (TOKEN, ENDPOINT_PASSWORD, PROXY_PASSWORD, "hf_test_", also):
            assert secret not in text, text


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_source(tmp_path_factory.mktemp("src") / "tiny")


@pytest.mark.parametrize("field,credentials", [("lastModified", "token"), ("createdAt", "endpoint URL")])
def test_a_mirror_that_echoes_the_authorization_header_in_a_200_answer(source, tmp_path, field, credentials):
    # the model info quotes the request's Authorization header in a date field: huggingface_hub cannot
    # parse it and raises with the header in its text. With credentials in HF_ENDPOINT the client sends
    # them as Basic auth (instead of the token), and the mirror takes them.
    basic = "Basic " + base64.b64encode(f"mirror:{ENDPOINT_PASSWORD}".encode()).decode()
    with HubServer() as hub:
        hub.add_token(TOKEN if credentials == "token" else basic, "me", ("org",))
        hub.add_model("org/tiny", source)
        hub.echo_auth_in = field
        host = hub.url.removeprefix("http://")
        endpoint = hub.url if credentials == "token" else f"http://mirror:{ENDPOINT_PASSWORD}@{host}"
        runs = Surgeon(tmp_path, endpoint).many(
            ["inspect", "org/tiny"], ["--debug", "inspect", "org/tiny"], token=TOKEN
        )
        sent = {r.auth for r in hub.requests}
    assert sent == {TOKEN if credentials == "token" else basic}  # what went out, and came back in the answer
    shown = hub.url if credentials == "token" else f"http://***@{host}"
    for run in runs:
        error = run.error  # one line, no traceback, non-zero exit (even with --debug: not a bug of surgeon's)
        assert error.startswith(
            f"surgeon: error: the Hub at {shown} answered for org/tiny with something huggingface_hub "
            f"cannot read (ValueError: Cannot parse '{'Bearer' if credentials == 'token' else 'Basic'} ***' "
            "as a datetime"
        ), error
        _assert_no_secret(run.stdout, run.stderr, also=basic.split()[1])


def test_what_the_hub_client_logs_is_redacted(source, tmp_path):
    # huggingface_hub logs each request it retries, with its URL, credentials included
    basic = "Basic " + base64.b64encode(f"mirror:{ENDPOINT_PASSWORD}".encode()).decode()
    with HubServer() as hub:
        hub.add_token(basic, "me", ("org",))
        hub.add_model("org/tiny", source)
        hub.fail("GET", r"/resolve/", status=429, times=1)  # the client retries a download after a 429
        host = hub.url.removeprefix("http://")
        run = Surgeon(tmp_path, f"http://mirror:{ENDPOINT_PASSWORD}@{host}")("inspect", "org/tiny")
    assert f"HTTP Error 429 thrown while requesting GET http://***@{host}/org/tiny/resolve/" in run.stderr, run.stderr
    assert "attention blocks" in run.stdout.lower()
    _assert_no_secret(run.stdout, run.stderr, also=basic.split()[1])


def test_credentials_in_the_endpoint_and_proxy_urls(tmp_path):
    closed = closed_port_url().removeprefix("http://")
    surgeon = Surgeon(tmp_path, f"http://mirror:{ENDPOINT_PASSWORD}@hub.invalid")
    proxy = f"http://someone:{PROXY_PASSWORD}@{closed}"
    surgeon.env.update(HTTP_PROXY=proxy, HTTPS_PROXY=proxy, ALL_PROXY=proxy, NO_PROXY="")
    [run] = surgeon.many(["inspect", "org/tiny"])
    assert "cannot reach the Hugging Face Hub at http://***@hub.invalid" in run.error, run.error
    _assert_no_secret(run.stdout, run.stderr)


def _boom(*args, **kwargs):
    raise RuntimeError(
        f"GET http://mirror:{ENDPOINT_PASSWORD}@hub.example/api failed\nrequest headers: Authorization: Bearer {TOKEN}"
    )


def test_an_unexpected_exception_is_one_redacted_line(cli, monkeypatch, llama_dir):
    monkeypatch.delenv("SURGEON_DEBUG", raising=False)
    monkeypatch.setattr(surgeon.api, "inspect_checkpoint", _boom)
    result = cli("inspect", llama_dir, ok=False)
    assert result.exit_code == 1
    assert result.stderr == (
        "surgeon: internal error: RuntimeError: GET http://***@hub.example/api failed (this is a bug: please report it; "
        "run with --debug (or SURGEON_DEBUG=1) for the traceback)\n"
    )
    assert result.stdout == ""


@pytest.mark.parametrize("how", ["--debug first", "--debug last", "SURGEON_DEBUG=1"])
def test_debug_shows_the_traceback_redacted(cli, monkeypatch, llama_dir, how):
    monkeypatch.setattr(surgeon.api, "inspect_checkpoint", _boom)
    args = ["inspect", str(llama_dir)]
    if how == "SURGEON_DEBUG=1":
        monkeypatch.setenv("SURGEON_DEBUG", "1")
    else:
        monkeypatch.delenv("SURGEON_DEBUG", raising=False)
        args = ["--debug", *args] if how == "--debug first" else [*args, "--debug"]
    result = cli(*args, ok=False)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert any("in _boom" in line for line in lines)
    assert "Authorization: Bearer ***" in result.stderr
    assert lines[-1].startswith(
        "surgeon: internal error: RuntimeError: GET http://***@hub.example/api failed (this is a bug"
    )
    _assert_no_secret(result.stderr, result.stdout)


def test_debug_changes_nothing_when_all_goes_well(cli, llama_dir):
    plain, debug = cli("inspect", llama_dir), cli("--debug", "inspect", llama_dir)
    assert plain.stdout == debug.stdout and "attention blocks" in plain.stdout.lower()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("cannot reach http://user:pass@host:8080/api", "cannot reach http://***@host:8080/api"),
        ("proxy https://token@proxy.corp failed", "proxy https://***@proxy.corp failed"),
        ("Proxy-Authorization: Basic dXNlcjpwYXNz", "Proxy-Authorization: Basic ***"),
        (
            "mail a@b.c or see http://host/x@y and git@github.com:org/x",
            "mail a@b.c or see http://host/x@y and git@github.com:org/x",
        ),
    ],
)
def test_redact_url_credentials(text, expected):
    assert redact(text) == expected


def test_redact_the_passwords_of_urls_in_the_environment(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", f"http://someone:{PROXY_PASSWORD}%21@proxy:3128")
    monkeypatch.setenv("HF_ENDPOINT", f"https://mirror:{ENDPOINT_PASSWORD}@hub.corp")
    # decoded, as typed, and as the Basic header carries it
    basic = base64.b64encode(f"someone:{PROXY_PASSWORD}!".encode()).decode()
    text = redact(f"got {PROXY_PASSWORD}! and {PROXY_PASSWORD}%21, header {basic}, and {ENDPOINT_PASSWORD}")
    assert text == "got *** and ***, header ***, and ***"


_LIBRARY_OUTPUT = r"""
import logging, sys, warnings
from surgeon.text.redact import redact_library_output
redact_library_output()
logging.basicConfig(stream=sys.stderr)
log = logging.getLogger("huggingface_hub.some_module")
secret = sys.argv[1]
log.warning("GET %s failed", f"http://mirror:{secret}@hub.example/api")
try:
    raise RuntimeError(f"Authorization: Bearer hf_{secret}{secret}")
except RuntimeError:
    log.exception("request failed")
warnings.warn(f"retrying http://mirror:{secret}@hub.example")
"""


def test_library_logs_warnings_and_logged_tracebacks_are_redacted():
    proc = subprocess.run(
        [sys.executable, "-c", _LIBRARY_OUTPUT, ENDPOINT_PASSWORD], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "GET http://***@hub.example/api failed" in proc.stderr
    assert "RuntimeError: Authorization: Bearer ***" in proc.stderr and "Traceback" in proc.stderr
    assert "retrying http://***@hub.example" in proc.stderr
    _assert_no_secret(proc.stderr, proc.stdout)
