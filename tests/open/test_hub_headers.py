"""A Hub model planned from its headers: `reinit --dry-run` reads the shards' headers by Range and no
weight bytes, `inspect` reads only the bytes of the tensors it measures, and a hostile header read over
Range is refused as the same file on disk is."""

from __future__ import annotations

import json
import struct

import pytest
from safetensors import safe_open

from helpers.hub import Surgeon, header_bytes, local_kappas, weights_served
from helpers.hub_server import HubServer


def test_dry_run_reads_headers_only(shards, hub, tmp_path):
    run = Surgeon(tmp_path, hub.url)("reinit", "org/M", "--layers", "-1", "--dry-run", "--json")
    assert not [f for f in hub.downloads() if f.endswith(".safetensors")]  # no weight file downloaded
    assert weights_served(hub) == header_bytes(shards)  # the headers, to the byte, and nothing else
    report = json.loads(run.stdout)
    assert {p["layer"] for p in report["projections"]} == {7}
    assert not list((tmp_path / "hf-home").rglob("model-*.safetensors"))


def test_inspect_reads_only_the_measured_tensors(shards, hub, tmp_path):
    report = json.loads(Surgeon(tmp_path, hub.url)("inspect", "org/M", "--json").stdout)
    measured = set()
    for path in shards.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            measured |= {
                (n, f.get_slice(n).get_shape()[0] * f.get_slice(n).get_shape()[1] * 4)
                for n in f.keys()
                if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
            }
    assert not [f for f in hub.downloads() if f.endswith(".safetensors")]
    assert weights_served(hub) == header_bytes(shards) + sum(size for _, size in measured)
    # the same numbers as the whole files on disk give
    assert [p["before"]["heads"] for p in report["projections"]] == local_kappas(shards)
    assert any("by HTTP Range" in n for n in report["notes"])


def corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    if how == "length":  # claims more header than the file holds
        data[:8] = struct.pack("<Q", len(data) + 10)
    elif how == "json":
        data[8 + n - 2] = ord("{")
    else:  # a tensor's bytes do not fit its shape
        data[8 : 8 + n] = bytes(data[8 : 8 + n]).replace(b'"shape":[64,64]', b'"shape":[64,65]', 1)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["length", "json", "shape"])
def test_hostile_headers_over_range_are_refused_as_local_ones(shards, tmp_path, how):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    victim = bad / "model-00003-of-00008.safetensors"
    corrupt(victim, how)
    with HubServer() as server:
        server.add_model("org/bad", bad)
        surgeon = Surgeon(tmp_path, server.url)
        local = surgeon("inspect", bad, ok=False).error
        remote = surgeon("inspect", "org/bad", ok=False).error
    assert str(victim) in local and "Hub model org/bad: " in remote
    # the same refusal, naming the file in the repo instead of on disk
    assert remote.split("Hub model org/bad: ", 1)[1] == local.split(f"{bad}/", 1)[1], (local, remote)
    assert not [f for f in server.downloads() if f.endswith(".safetensors")]
