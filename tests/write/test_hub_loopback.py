"""The loopback Hub does what the real one does for reads by Range and server-side copies, driven by the
real huggingface_hub client: slices of a file answered 206, LFS entries with their sha256 and Xet hash,
large files kept per repository, cross-repo copies through the duplicate endpoint and its refusals."""

from __future__ import annotations

import hashlib
import struct

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationCopy, HfApi
from huggingface_hub.utils import get_session

from helpers.hub import OTHER_TOKEN, TOKEN
from helpers.hub_server import HubServer

pytestmark = pytest.mark.skipif(
    "src_repo_id" not in CommitOperationCopy.__dataclass_fields__,
    reason="this huggingface_hub has no cross-repo copies (1.17 or newer has)",
)

_HEADER = b'{"a":{"dtype":"U8","shape":[40],"data_offsets":[0,40]}}'
WEIGHTS = struct.pack("<Q", len(_HEADER)) + _HEADER + bytes(range(40))  # a safetensors file of one tensor


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """The client in this process talks to the loopback Hub (the suite sets HF_HUB_OFFLINE for everything else),
    through its LFS path (HF_HUB_DISABLE_XET, the client's documented switch: the loopback Hub speaks no Xet)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


def served(hub: HubServer) -> HubServer:
    hub.add_token(TOKEN, "me", ("org",))
    hub.add_token(OTHER_TOKEN, "stranger")
    hub.add_model("org/M", {"model.safetensors": WEIGHTS, "config.json": b"{}"})
    hub.add_model("org/secret", {"model.safetensors": WEIGHTS}, private=True)
    return hub


def test_range_answers_206_with_the_slice_lowercase_header():
    with served(HubServer()) as hub:
        url = f"{hub.url}/org/M/resolve/main/model.safetensors"
        for asked, want in (("bytes=8-15", WEIGHTS[8:16]), ("bytes=-4", WEIGHTS[-4:]), ("bytes=60-", WEIGHTS[60:])):
            r = get_session().get(url, headers={"range": asked})  # lowercase, as huggingface_hub sends it
            assert r.status_code == 206 and r.content == want, asked
            assert r.headers["content-range"].endswith(f"/{len(WEIGHTS)}")
        assert hub.served(r"/resolve/") == 8 + 4 + (len(WEIGHTS) - 60)  # the slices' bytes, nothing more
        assert get_session().get(url, headers={"range": f"bytes={len(WEIGHTS)}-"}).status_code == 416
        full = get_session().get(url)
        assert full.status_code == 200 and full.content == WEIGHTS


def test_paths_info_lists_lfs_and_xet_oids():
    with served(HubServer()) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        weights, config = api.get_paths_info("org/M", ["model.safetensors", "config.json", "absent"])
        assert weights.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest() and weights.xet_hash
        assert weights.xet_hash != weights.lfs.sha256 and config.lfs is None and config.xet_hash is None


def test_large_files_are_kept_per_repository():
    """Bytes another repo holds do not make an upload free: they are sent again."""
    with served(HubServer()) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo("me/again")
        api.create_commit("me/again", [CommitOperationAdd("model.safetensors", WEIGHTS)], commit_message="up")
        assert hub.lfs_uploads() == [hashlib.sha256(WEIGHTS).hexdigest()]
        assert hub.received(r"^/__lfs/") >= len(WEIGHTS)


def test_cross_repo_copy_goes_through_the_duplicate_endpoint():
    with served(HubServer()) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        sha = api.model_info("org/M").sha
        api.create_repo("me/copy")
        ops = [
            CommitOperationCopy(
                "model.safetensors", "model.safetensors", src_repo_id="org/M", src_repo_type="model", src_revision=sha
            )
        ]
        api.create_commit("me/copy", ops, commit_message="copy")
        assert hub.files("me/copy")["model.safetensors"] == WEIGHTS
        assert hub.lfs_uploads() == [] and hub.received(r"^/__lfs/") == 0  # not one weight byte was uploaded
        (dup,) = hub.duplicated()
        assert (dup["source"], dup["target"], dup["filename"]) == ("org/M", "me/copy", "model.safetensors")


def test_copy_refusals():
    from huggingface_hub.errors import FileDuplicationError, HfHubHTTPError

    with served(HubServer()) as hub:
        mine, theirs = HfApi(endpoint=hub.url, token=TOKEN), HfApi(endpoint=hub.url, token=OTHER_TOKEN)
        mine.create_repo("me/copy")
        theirs.create_repo("stranger/copy")

        def copy(api, repo, src="org/M"):
            op = CommitOperationCopy("model.safetensors", "w.safetensors", src_repo_id=src, src_repo_type="model")
            api.create_commit(repo, [op], commit_message="copy")

        with pytest.raises(HfHubHTTPError) as private:  # a source the token cannot read
            copy(theirs, "stranger/copy", "org/secret")
        assert private.value.response.status_code == 404
        hub.refuse_duplicate = "source and target are in different storage regions"
        with pytest.raises(FileDuplicationError, match="different storage regions"):
            copy(mine, "me/copy")
        assert "w.safetensors" not in hub.files("me/copy") and hub.duplicated() == []
