"""A Hub that lies, stalls or loops never hangs surgeon nor fills its memory (surgeon/hub/http.py).

Each test puts a lying proxy (``helpers.lying_hub``) in front of the loopback Hub and runs the real ``surgeon``
command in a fresh process against it, with short limits set the way users set them (the SURGEON_HUB_*
environment variables): it fails with one line naming the host, writes nothing, and, where the lie is a body
without end, the proxy counted what it sent: no more than what was asked, plus what the sockets hold.
A command that hangs is stopped by the test's own guard (a subprocess timeout far beyond a normal run).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.hub import Run, Surgeon, make_source
from helpers.hub_server import HubServer
from helpers.lying_hub import DRIP, ENDLESS, LOOP, PING_PONG, STALL, LyingHub

LIMITS = {
    "SURGEON_HUB_CONNECT_TIMEOUT": "5",
    "SURGEON_HUB_READ_TIMEOUT": "3",
    "SURGEON_HUB_DEADLINE": "6",
    "SURGEON_HUB_MAX_REDIRECTS": "4",
    "SURGEON_HUB_MAX_ANSWER": str(1024 * 1024),
}
HANG_GUARD = 60  # seconds; a run under the limits above ends in a few
SLACK = 1024 * 1024  # what the proxy may count as sent beyond what was asked: the sockets' buffers
HEADER_READ = (r"/model\.safetensors$", r"^bytes=8-")  # the Range read of the weights' header
MODEL_INFO = r"^/api/models/org/tiny$"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_source(tmp_path_factory.mktemp("source") / "tiny")


@pytest.fixture
def proxy(source):
    with HubServer() as hub:
        hub.add_model("org/tiny", source)
        with LyingHub(hub.url) as lying:
            yield lying


def surgeon(tmp_path, proxy: LyingHub, *args: str) -> Run:
    """``surgeon ARGS`` in a fresh process against the lying Hub, under LIMITS, stopped by HANG_GUARD."""
    env = dict(Surgeon(tmp_path, proxy.url).env, **LIMITS)
    proc = subprocess.run(
        [sys.executable, "-m", "surgeon", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def refused(tmp_path, proxy: LyingHub, kind: str, *args: str) -> str:
    """The one-line error of a run the proxy lied to (``kind``), which names the host and wrote nothing."""
    run = surgeon(tmp_path, proxy, *args)
    error = run.error  # exit status not 0, one line "surgeon: error: ...", no traceback
    assert proxy.told(kind), f"the lie was never told: {error}"
    assert proxy.host in error, error
    assert {p.name for p in tmp_path.iterdir()} <= {"hf-home"}  # no output, no journal, nothing else
    assert not list(tmp_path.rglob("*.safetensors"))  # and no weights in the HF cache
    assert proxy.settle(), "a lie was still being told after the run ended"
    return error


def test_an_endless_answer_to_a_range_read_is_cut_off_at_the_bytes_asked(tmp_path, proxy):
    proxy.lie(ENDLESS, HEADER_READ[0], range=HEADER_READ[1])
    error = refused(tmp_path, proxy, ENDLESS, "inspect", "org/tiny")
    assert "sent more than" in error and "for a range of" in error, error
    (lie,) = proxy.told(ENDLESS)
    first, last = (int(n) for n in lie.range.removeprefix("bytes=").split("-"))
    assert lie.sent <= (last - first + 1) + SLACK, lie.sent  # memory stayed bounded: the body was not read whole


def test_a_range_answer_that_stalls_after_its_headers_times_out(tmp_path, proxy):
    proxy.lie(STALL, HEADER_READ[0], range=HEADER_READ[1])
    error = refused(tmp_path, proxy, STALL, "inspect", "org/tiny")
    assert "did not answer" in error and "within 3 s (SURGEON_HUB_READ_TIMEOUT)" in error, error


def test_a_range_answer_that_drips_runs_out_of_time(tmp_path, proxy):
    proxy.lie(DRIP, HEADER_READ[0], range=HEADER_READ[1], interval=1.0)  # each byte within the read timeout
    error = refused(tmp_path, proxy, DRIP, "reinit", "org/tiny", "--dry-run")
    assert "did not finish answering" in error and "SURGEON_HUB_DEADLINE" in error, error
    (lie,) = proxy.told(DRIP)
    first, last = (int(n) for n in lie.range.removeprefix("bytes=").split("-"))
    assert 0 < lie.sent < last - first + 1, lie.sent  # it was dripping, and was left before the end


@pytest.mark.parametrize(
    ("kind", "command"), [(LOOP, ["inspect", "org/tiny"]), (PING_PONG, ["reinit", "org/tiny", "--dry-run"])]
)
def test_a_redirect_loop_on_a_range_read_stops_at_the_cap(tmp_path, proxy, kind, command):
    proxy.lie(kind, HEADER_READ[0], range=HEADER_READ[1])
    error = refused(tmp_path, proxy, kind, *command)
    assert "redirected" in error and "more than 4 times" in error, error
    assert len(proxy.told(kind)) == 5  # the request and its 4 redirects, no more


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (ENDLESS, f"sent more than {1024 * 1024} bytes for /api/models/org/tiny"),
        (STALL, "cannot reach the Hugging Face Hub at http://"),  # no answer in time: as if unreachable
        (LOOP, "redirected /api/models/org/tiny more than 4 times"),
    ],
)
def test_the_clients_own_requests_run_under_the_same_limits(tmp_path, proxy, kind, expected):
    """huggingface_hub's model_info for surgeon: its body is capped, it times out, its redirects are capped."""
    proxy.lie(kind, MODEL_INFO)
    error = refused(tmp_path, proxy, kind, "inspect", "org/tiny")
    assert expected in error, error
    if kind == ENDLESS:
        assert sum(lie.sent for lie in proxy.told(ENDLESS)) <= 1024 * 1024 + SLACK


def test_a_limit_that_is_not_a_number_is_one_line(tmp_path, proxy):
    env = dict(Surgeon(tmp_path, proxy.url).env, SURGEON_HUB_READ_TIMEOUT="soon")
    proc = subprocess.run(
        [sys.executable, "-m", "surgeon", "inspect", "org/tiny"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    error = Run(proc.returncode, proc.stdout, proc.stderr).error
    assert "SURGEON_HUB_READ_TIMEOUT='soon' is not a number above 0" in error, error
