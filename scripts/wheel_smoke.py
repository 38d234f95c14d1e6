"""Smoke test of an installed attention-surgeon (run by scripts/wheel_check.sh in a fresh venv).

Run it with the venv's python from a folder outside the source tree: it fails unless ``surgeon`` is
imported from that venv's site-packages, installed from a wheel (not editable). It builds a tiny BERT
(safetensors + config.json, from torch alone), then runs the installed commands on it: ``surgeon
--version``, ``inspect``, ``reinit``, ``verify`` (and verify catching a changed byte), a bad input,
``python -m surgeon``, every command's help, ``reinit --in-place``, ``recover``, ``push`` without a
token; and checks the py.typed marker and the wrapped private APIs (surgeon._compat).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata, resources
from pathlib import Path

DIST = "attention-surgeon"
BIN = Path(sys.executable).parent


def run(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(Path(tempfile.gettempdir()) / "surgeon-smoke-hf"))  # no stored token
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    if proc.returncode != expect:
        sys.exit(f"FAIL: {' '.join(args)} exited {proc.returncode}, not {expect}\n{proc.stdout}\n{proc.stderr}")
    return proc


def check_installed() -> str:
    import surgeon

    where = Path(surgeon.__file__).resolve().parent
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert where.parent == site, f"surgeon imported from {where}, not from {site}"
    dist = metadata.distribution(DIST)
    direct = dist.read_text("direct_url.json")
    assert not (direct and json.loads(direct).get("dir_info", {}).get("editable")), "an editable install"
    assert dist.version == surgeon.__version__, (dist.version, surgeon.__version__)
    assert (resources.files("surgeon") / "py.typed").is_file(), "py.typed is missing"
    assert any(str(f) == "surgeon/py.typed" for f in dist.files or ()), "py.typed is not in the RECORD"
    assert dist.entry_points.select(group="console_scripts", name="surgeon"), "no surgeon command"
    from surgeon import _compat

    _compat.check()  # every private torch / huggingface_hub API surgeon uses is there
    print(f"ok: {DIST} {dist.version} from {where}, py.typed present, private APIs resolve")
    return dist.version


def write_safetensors(path: Path, tensors: dict) -> None:
    """The safetensors layout by hand (8-byte header length, JSON header, raw data): surgeon needs no library."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def read_safetensors(path: Path) -> dict[str, bytes]:
    """Each tensor's raw bytes."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    header.pop("__metadata__", None)
    return {k: blob[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]] for k, v in header.items()}


def tiny_bert(folder: Path) -> None:
    """A 2-layer BERT's tensors under BERT's names, random, with its config.json."""
    import torch

    g = torch.Generator().manual_seed(0)
    width, tensors = 32, {}
    for i in range(2):
        pre = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            tensors[f"{pre}attention.self.{name}.weight"] = torch.randn(width, width, generator=g) * 0.05
            tensors[f"{pre}attention.self.{name}.bias"] = torch.randn(width, generator=g) * 0.01
        tensors[f"{pre}attention.output.dense.weight"] = torch.randn(width, width, generator=g) * 0.05
        tensors[f"{pre}intermediate.dense.weight"] = torch.randn(64, width, generator=g) * 0.05
        tensors[f"{pre}output.dense.weight"] = torch.randn(width, 64, generator=g) * 0.05
    tensors["embeddings.word_embeddings.weight"] = torch.randn(50, width, generator=g)
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors)
    config = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "hidden_size": width,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "vocab_size": 50,
    }
    (folder / "config.json").write_text(json.dumps(config))


def check_commands(work: Path, version: str) -> None:
    surgeon = str(BIN / "surgeon")
    for cmd in ([surgeon], [sys.executable, "-m", "surgeon"]):
        out = run(*cmd, "--version").stdout
        assert version in out, f"{cmd} --version says {out!r}, not {version}"
    listing = run(sys.executable, "-m", "surgeon", "--help").stdout.split("Commands:")[1]
    commands = [line.split()[0] for line in listing.strip().splitlines()]
    assert set(commands) >= {"inspect", "reinit", "verify", "push", "recover"}, commands
    for command in commands:
        run(surgeon, command, "--help")
    model, out = work / "tiny", work / "tiny-reinit"
    tiny_bert(model)

    report = json.loads(run(surgeon, "inspect", str(model), "--json").stdout)
    assert len(report["blocks"]) == 2 and {b["heads"] for b in report["blocks"]} == {4}, report["blocks"]
    run(surgeon, "reinit", str(model), "--layers", "all", "--seed", "3", "-o", str(out))
    before, after = read_safetensors(model / "model.safetensors"), read_safetensors(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    changed = sorted(n for n in before if before[n] != after[n])
    assert len(changed) == 12 and all(".attention.self." in n for n in changed), changed  # q/k/v weights and biases
    kappas = json.loads(run(surgeon, "inspect", str(out), "--json").stdout)["projections"]
    worst = max(p["before"]["head_kappa"]["max"] for p in kappas)
    assert len(kappas) == 6 and worst < 1 + 1e-5, worst
    verdict = run(surgeon, "verify", str(model), str(out)).stdout
    assert verdict.startswith("verified:"), verdict
    print(f"ok: inspect, reinit (12 tensors changed, head kappa <= {worst:.7f}), verify: {verdict.strip()[:80]}...")

    tampered = work / "tampered"
    shutil.copytree(out, tampered)
    data = bytearray((tampered / "model.safetensors").read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor's data
    (tampered / "model.safetensors").write_bytes(bytes(data))
    run(surgeon, "verify", str(model), str(tampered), expect=3)

    err = run(surgeon, "inspect", str(work / "missing"), expect=1).stderr
    assert err.startswith("surgeon: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    print("ok: verify refuses a changed byte (exit 3); a bad input is one line, exit 1")

    patched = work / "in-place"
    shutil.copytree(model, patched)
    run(surgeon, "reinit", str(patched), "--layers", "all", "--seed", "3", "--in-place")
    assert read_safetensors(patched / "model.safetensors") == after, "in place differs from the -o output"
    assert "nothing to recover" in run(surgeon, "recover", str(patched / "model.safetensors")).stdout
    err = run(surgeon, "push", str(out), "org/tiny", expect=1).stderr  # no token: refused before any upload
    assert err.startswith("surgeon: error:") and "token" in err and err.count("\n") == 1, err
    print(
        "ok: reinit --in-place gives the -o output's tensors, recover has nothing to do, push without a token is one line"
    )


def main() -> None:
    version = check_installed()
    with tempfile.TemporaryDirectory() as tmp:
        check_commands(Path(tmp), version)
    print("wheel smoke test passed")


if __name__ == "__main__":
    main()
