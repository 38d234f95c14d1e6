"""Helpers for the Hub tests: a source model with the usual extras, a hand-built HF cache, and the real
``surgeon`` command run in a fresh process with its own environment.

The command runs as a subprocess because huggingface_hub reads HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE
once, at import: a fresh process with its own environment is how users set them, and the only way to
test that surgeon honours them without patching the client.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.hub_server import HubServer
from helpers.tiny import tiny_llama

TOKEN = "hf_test_Wm9yYmlkZGVuLW5ldmVyLXByaW50ZWQ"  # distinctive, so a leak anywhere is found by search
OTHER_TOKEN = "hf_test_b3RoZXItdXNlci10b2tlbg"
SOURCE_CARD = """---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
- llama
- tiny-test-model
datasets:
- org/pretraining-corpus
model-index:
- name: tiny
  results:
  - task: {type: text-generation}
    dataset: {name: corpus, type: org/pretraining-corpus}
    metrics:
    - {type: perplexity, value: 12.5}
---

# Tiny Llama

A 3-layer Llama for tests. Trained on nothing in particular.

## Uses

Only tests.
"""
SOURCE_BODY = SOURCE_CARD.split("---\n", 2)[2]


def make_source(folder: Path, *, seed: int = 0, shard: str | None = None) -> Path:
    """A Hub-style model folder: safetensors weights, config, tokenizer, a card, plus copies of the same
    weights in other formats (pytorch_model.bin, onnx/) and training leftovers surgeon must not fetch."""
    torch.manual_seed(seed)
    model = tiny_llama()
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * seed * torch.randn_like(p))
    if shard:
        model.save_pretrained(folder, max_shard_size=shard)
    else:
        model.save_pretrained(folder)
    (folder / "README.md").write_text(SOURCE_CARD)
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "training_args.bin").write_bytes(b"not weights")
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"an onnx export of the same model")
    (folder / "onnx" / "config.json").write_text("{}")
    return folder


@contextmanager
def serving(repo_id: str, folder: Path) -> Iterator[HubServer]:
    """A loopback Hub holding ``folder`` as ``repo_id``, with TOKEN (user ``me``, member of ``org``)."""
    with HubServer() as server:
        server.add_token(TOKEN, "me", ("org",))
        server.add_model(repo_id, folder)
        yield server


def make_llama_shards(folder: Path) -> Path:
    """A Llama-shaped model folder of 8 safetensors shards (8 layers, saved by transformers' own
    save_pretrained with a small max_shard_size), with a card and tokenizer files, as Hub repos hold them:
    the last layer's q/k/v are in one shard (model-00007-of-00008)."""
    model = tiny_llama(num_hidden_layers=8)
    model.save_pretrained(folder, max_shard_size="140KB")
    assert len(list(folder.glob("*.safetensors"))) == 8, sorted(folder.iterdir())
    (folder / "README.md").write_text(SOURCE_CARD)
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return folder


def build_cache(hf_home: Path, repo_id: str, files: dict[str, bytes], *, refs: tuple[str, ...] = ("main",)) -> str:
    """The HF cache layout, written by hand: blobs/<etag>, snapshots/<commit>/<path> -> ../../blobs/<etag>,
    refs/<branch> holding the commit. Returns the commit hash."""
    storage = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1("\0".join([repo_id, *sorted(files)]).encode()).hexdigest()
    for path, content in files.items():
        etag = hashlib.sha256(content).hexdigest()
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = storage / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return commit


def closed_port_url() -> str:
    """An http URL on loopback where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str

    @property
    def error(self) -> str:
        """The one-line error of a failed run (asserts it is exactly one line, without a traceback)."""
        assert self.rc != 0, self.stdout
        assert "Traceback" not in self.stderr + self.stdout, self.stderr
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, self.stderr
        assert lines[0].startswith("surgeon: error: "), lines[0]
        return lines[0]


class Surgeon:
    """``surgeon ARGS`` in a fresh process: HF_HOME in the test's folder, HF_ENDPOINT at the loopback Hub."""

    def __init__(self, cwd: Path, endpoint: str) -> None:
        self.cwd = cwd
        self.hf_home = cwd / "hf-home"
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING")) and "proxy" not in k.lower()
        }
        self.env.update(
            HF_HOME=str(self.hf_home),
            HF_ENDPOINT=endpoint,
            HF_HUB_OFFLINE="0",
            # The loopback Hub speaks the LFS protocol, not Xet's: the client's documented switch to LFS.
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            NO_PROXY="127.0.0.1,localhost",
        )

    def _env(self, token: str | None, offline: bool) -> dict:
        env = dict(self.env, HF_HUB_OFFLINE="1" if offline else "0")
        if token:
            env["HF_TOKEN"] = token
        return env

    def __call__(self, *args, ok: bool = True, token: str | None = None, offline: bool = False) -> Run:
        proc = subprocess.run(
            [sys.executable, "-m", "surgeon", *map(str, args)],
            cwd=self.cwd,
            env=self._env(token, offline),
            capture_output=True,
            text=True,
            timeout=300,
        )
        run = Run(proc.returncode, proc.stdout, proc.stderr)
        if ok and run.rc != 0:
            raise AssertionError(f"surgeon {' '.join(map(str, args))} failed ({run.rc}):\n{run.stderr}\n{run.stdout}")
        return run

    def many(self, *calls: list, token: str | None = None, offline: bool = False) -> list[Run]:
        """Several ``surgeon`` commands, one after the other, in one fresh process with this environment."""
        proc = subprocess.run(
            [sys.executable, "-c", _MANY],
            cwd=self.cwd,
            env=self._env(token, offline),
            capture_output=True,
            text=True,
            input=json.dumps([[str(a) for a in call] for call in calls]),
            timeout=600,
        )
        assert proc.returncode == 0 and "\0" in proc.stdout, proc.stderr
        return [Run(*r) for r in json.loads(proc.stdout.rsplit("\0", 1)[1])]


# Runs several commands in one fresh process (one import of torch instead of one per command). Each
# command's stdout and stderr are captured at the file-descriptor level, so everything it prints,
# huggingface_hub's own warnings included, is seen; an escaped exception prints its traceback there.
_MANY = r"""
import json, os, sys, tempfile, traceback
from surgeon.cli.commands import main
results = []
for args in json.loads(sys.stdin.read()):
    saved, files = [os.dup(1), os.dup(2)], [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
    try:
        main.main(args, prog_name="surgeon", standalone_mode=True)
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    out = []
    for f in files:
        f.seek(0)
        out.append(f.read().decode())
    results.append([rc, *out])
sys.stdout.write("\0" + json.dumps(results))
"""


def digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def all_text_under(folder: Path) -> str:
    """Every byte under ``folder`` (following the cache's symlinks), for leak searches."""
    return "".join(p.read_bytes().decode("latin-1") for p in sorted(Path(folder).rglob("*")) if p.is_file())


def header_bytes(folder: Path) -> int:
    """8 + N for every safetensors shard of ``folder``, N read from the file's first 8 bytes: its header's bytes."""
    import struct

    return sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in folder.glob("*.safetensors"))


def weights_served(hub: Any, since: int = 0) -> int:
    """The bytes of safetensors files the loopback Hub sent (whole or by Range), from request ``since`` on."""
    return sum(r.sent for r in hub.requests[since:] if r.method == "GET" and r.path.endswith(".safetensors"))


def local_kappas(path: Path) -> list[Any]:
    """Per-head kappas of a local checkpoint, row by row, to compare with a report's ``before.heads``.

    Each row is a ``pytest.approx`` to 1e-9: two processes agree to the last digit or two only, as
    LAPACK promises nothing more between runs.
    """
    from surgeon import inspect_checkpoint

    return [pytest.approx(list(r.before.head_kappas), rel=1e-9) for r in inspect_checkpoint(path).rows]
