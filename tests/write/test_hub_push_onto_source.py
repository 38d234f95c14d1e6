"""A push onto the branch its model was read from rewrites that model: refused unless asked for (``--in-place``, the
Hub's meaning of it); a branch or a pull request on the source repo is fine. Judged by what the loopback Hub holds,
read back with safetensors' own reader."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from helpers.hub import TOKEN, Surgeon, serving
from helpers.tiny import tiny_llama

Q = "model.layers.0.self_attn.q_proj.weight"
Q_LAST = "model.layers.2.self_attn.q_proj.weight"


def _weights(hub, repo: str, branch: str = "main") -> dict[str, torch.Tensor]:
    return load(hub.files(repo, branch)["model.safetensors"])


@pytest.fixture
def tiny_on_hub(tmp_path):
    """A tiny Llama as org/tiny on a loopback Hub, its folder, and the command run from an empty folder."""
    torch.manual_seed(0)
    source = tmp_path / "src"
    tiny_llama().save_pretrained(source)
    work = tmp_path / "work"
    work.mkdir()
    with serving("org/tiny", source) as hub:
        yield hub, Surgeon(work, hub.url), source, work


def test_a_push_over_the_branch_read_is_refused_unless_asked_for(tiny_on_hub):
    hub, surgeon, _, work = tiny_on_hub
    main_before = hub.repos["org/tiny"].branches["main"]
    before = _weights(hub, "org/tiny")
    refused = surgeon("reinit", "org/tiny", "--layers", "0", "--push-to-hub", "org/tiny", ok=False, token=TOKEN)
    lines = refused.stderr.strip().splitlines()
    assert refused.rc != 0 and len(lines) == 1 and "Traceback" not in refused.stderr
    assert "org/tiny is the model read, and the push would commit over its main branch: pass --in-place" in lines[0]
    assert hub.repos["org/tiny"].branches["main"] == main_before and hub.pushed == []
    assert sorted(p.name for p in work.iterdir()) == ["hf-home"]  # no staging folder, no output
    # a branch of the source repo is fine: main is left as it was
    surgeon("reinit", "org/tiny", "--layers", "0", "--push-to-hub", "org/tiny", "--push-branch", "reset", token=TOKEN)
    assert hub.repos["org/tiny"].branches["main"] == main_before
    on_branch = _weights(hub, "org/tiny", "reset")
    assert not torch.equal(on_branch[Q], before[Q]) and torch.equal(on_branch[Q_LAST], before[Q_LAST])
    # asked for: the source's own main is rewritten, with the same re-initialization
    surgeon(
        "reinit", "org/tiny", "--layers", "0", "--push-to-hub", "org/tiny", "--in-place", "-o", "staged",
        token=TOKEN,
    )  # fmt: skip
    assert hub.repos["org/tiny"].branches["main"] != main_before
    after = _weights(hub, "org/tiny")
    assert torch.equal(after[Q], on_branch[Q]) and torch.equal(after[Q_LAST], before[Q_LAST])
    assert set(after) == set(before)


def test_in_place_with_a_push_names_the_model_read(tiny_on_hub):
    """``--in-place`` with a push means the branch read: a local model, or another repo, is refused in one line."""
    hub, surgeon, source, work = tiny_on_hub
    other = surgeon("reinit", "org/tiny", "--in-place", "--push-to-hub", "me/x", ok=False, token=TOKEN)
    local = surgeon("reinit", source, "--in-place", "--push-to-hub", "me/x", ok=False, token=TOKEN)
    assert hub.pushed == [] and sorted(p.name for p in work.iterdir()) == ["hf-home"]
    assert "the model read is org/tiny@main, not me/x@main: leave out --in-place" in other.error
    assert f"the model read is the local {source}" in local.error
