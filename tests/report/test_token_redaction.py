"""A Hub token is never shown or written: not in errors, notes, reports, cards or metadata records,
on the read path or the push path, even when a server echoes the Authorization header back."""

from __future__ import annotations

import json

import pytest

from surgeon import reinit_checkpoint
from surgeon.options import ReinitOptions
from surgeon.plan.planner import Plan
from surgeon.text.redact import redact

from helpers.hub import TOKEN, Surgeon, all_text_under, make_source, serving

STRANGER_TOKEN = "hf_QWxsIHlvdXIgYmFzZSBhcmUgYmVsb25n"  # shaped like a token, known to no one


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_source(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture
def hub(source):
    with serving("org/tiny", source) as server:
        yield server


def _assert_clean(*texts: str) -> None:
    for text in texts:
        assert TOKEN not in text and STRANGER_TOKEN not in text
        assert "hf_test_" not in text and "hf_QWxs" not in text


def test_read_path_error_that_echoes_the_authorization_header(hub, tmp_path):
    hub.fail(
        "GET",
        r"^/api/models/org/tiny",
        status=400,
        times=None,
        message=f"rejected credentials (also {STRANGER_TOKEN}):",
        echo_auth=True,
    )
    run = Surgeon(tmp_path, hub.url)("inspect", "org/tiny", token=TOKEN, ok=False)
    assert any(r.auth == TOKEN for r in hub.requests)  # the token was sent, and the server echoed it
    error = run.error
    assert "the Hub answered 400 for org/tiny: rejected credentials (also hf_***): Bearer ***" in error, error
    _assert_clean(run.stdout, run.stderr)


def test_push_path_error_that_echoes_the_authorization_header(hub, source, tmp_path):
    out = tmp_path / "out"
    reinit_checkpoint(source, output=out, layers="0")
    hub.fail("POST", r"/preupload/", status=400, times=None, message="rejected credentials", echo_auth=True)
    surgeon = Surgeon(tmp_path, hub.url)
    push, reinit = surgeon.many(
        ["push", out, "me/x"], ["reinit", "org/tiny", "-o", "kept", "--push-to-hub", "me/y"], token=TOKEN
    )
    assert "rejected credentials Bearer ***" in push.error, push.error
    assert "wrote kept, but the push failed" in reinit.error and "Bearer ***" in reinit.error
    _assert_clean(push.stdout, push.stderr, reinit.stdout, reinit.stderr, all_text_under(tmp_path / "kept"))


def test_token_shapes_in_cards_records_and_messages(cli, tmp_path, source):
    # a token pasted into the source's card is masked in the output's card
    src = tmp_path / "src"
    src.mkdir()
    for f in source.iterdir():
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    (src / "README.md").write_text((source / "README.md").read_text() + f"\nexport HF_TOKEN={STRANGER_TOKEN}\n")
    cli("reinit", src, "--layers", "0", "-o", tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "export HF_TOKEN=hf_***" in card
    _assert_clean(card)
    # a token typed into an option: the error message and the metadata record never show it
    result = cli("reinit", src, "--stack", STRANGER_TOKEN, ok=False)
    assert result.stderr == "surgeon: error: no stack named 'hf_***': this model's stacks are model.layers\n"
    record = Plan(ReinitOptions(stack=STRANGER_TOKEN), blocks=[]).record()
    assert record["options"]["stack"] == ["hf_***"]
    _assert_clean(json.dumps(record))


@pytest.mark.parametrize(
    "text,expected",
    [
        (f"Authorization: Bearer {STRANGER_TOKEN}", "Authorization: Bearer ***"),
        ("Bearer abc.def-ghi", "Bearer ***"),
        (f"token={STRANGER_TOKEN}", "token=***"),
        ("token: s3cr3t, then", "token: ***, then"),
        ("the token in use cannot write to org/x", "the token in use cannot write to org/x"),
        (f"org token api_org_{'x' * 30} leaked", "org token api_org_*** leaked"),
        ("hf_hub_download failed in hf_cache", "hf_hub_download failed in hf_cache"),  # ordinary words stay
        ("layers 0-3 of org/model", "layers 0-3 of org/model"),
    ],
)
def test_redact(text, expected):
    assert redact(text) == expected
