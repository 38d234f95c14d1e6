"""Init modes: every mode fills every slot of the registry, and cards and records say what each mode did."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open

from surgeon import reinit_checkpoint
from surgeon.modes import Mode, all_modes, get_mode, owner_of
from surgeon.options import MODES, ReinitOptions

from helpers.tiny import tiny_bert

SLOTS = (
    "name",
    "help",
    "fresh",
    "parameters",
    "method",
    "label",
    "tag",
    "exact",
    "verify_bound",
    "writes_outputs",
    "sharded",
    "citation",
)
METHODS = ("draw", "summary", "card_intro", "card_row")  # a mode must say these itself; the others have honest defaults


@pytest.mark.parametrize("mode", all_modes(), ids=lambda m: m.name)
def test_every_mode_fills_every_slot(mode):
    for slot in SLOTS:
        assert hasattr(type(mode), slot), f"{type(mode).__name__} leaves {slot} empty"
    for name in ("name", "help", "method", "label", "tag", "verify_bound"):
        assert isinstance(getattr(mode, name), str) and getattr(mode, name), name
    for name in ("fresh", "exact", "writes_outputs", "sharded"):
        assert isinstance(getattr(mode, name), bool), name
    assert all(p.name in {f.name for f in dataclasses.fields(ReinitOptions)} for p in mode.parameters)
    for name in METHODS:
        assert getattr(type(mode), name) is not getattr(Mode, name), f"{type(mode).__name__} does not define {name}"
    assert get_mode(mode.name) is mode and mode.name in MODES


def test_names_methods_and_tags_are_distinct_and_options_have_one_owner():
    modes = all_modes()
    for attr in ("name", "method", "label", "tag"):
        values = [getattr(m, attr) for m in modes]
        assert len(set(values)) == len(values), attr
    declared = [p.name for m in modes for p in m.parameters]
    assert {"gain", "std"} <= set(declared)
    for option in declared:
        owners = [m.name for m in modes if any(p.name == option for p in m.parameters)]
        assert len(owners) == 1 and owner_of(option).name == owners[0]
    assert owner_of("strength") is None  # every mode takes --strength, each saying what t does (strength_help)


def test_no_module_outside_modes_compares_mode_names():
    """Plan, engine, verify, report, card and the sharded path ask the mode instead."""
    import surgeon

    offenders = []
    for path in Path(inspect.getfile(surgeon)).parent.rglob("*.py"):
        if "modes" in path.parts:
            continue
        text = path.read_text()
        for name in MODES:
            for pattern in (f'mode == "{name}"', f'mode != "{name}"', f'"{name}" mode', '.mode in ("'):
                if pattern in text:
                    offenders.append(f"{path.name}: {pattern}")
    assert not offenders


@pytest.fixture
def bert_dir(tmp_path):
    path = tmp_path / "bert"
    tiny_bert().save_pretrained(path)
    return path


@pytest.mark.parametrize("mode", MODES)
def test_card_and_record_say_what_was_done(bert_dir, tmp_path, mode, cli):
    out = tmp_path / f"out-{mode}"
    source = ()
    if get_mode(mode).reference:  # restore: another checkpoint of the same architecture to take values from
        other = tiny_bert()
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(1.5)
        other.save_pretrained(tmp_path / "source")
        source = ("--from", tmp_path / "source")
    reinit_checkpoint(bert_dir, output=out, mode=mode, **{"from_": str(source[1])} if source else {})
    with safe_open(out / "model.safetensors", "np") as f:
        (record,) = json.loads(f.metadata()["surgeon"])
    assert record["method"] == get_mode(mode).method and record["options"]["mode"] == mode

    card = ModelCard.load(out / "README.md")
    text = card.text.split("## Reproduce")[0]
    assert card.data.to_dict()["tags"] == ["surgeon", get_mode(mode).tag]
    claims_conditioned = "with conditioned initialization" in text or "semi-orthogonal" in text
    assert claims_conditioned == (mode == "conditioned"), text
    words = {
        "conditioned": "rectangular identity",
        "polar": "singular vectors kept",
        "redraw": "default init",
        "mimetic": "W_O",
        "restore": "take the values of `source`",
    }
    assert words[mode] in text
    if mode == "redraw":
        assert "not conditioned initialization" in text and "normal(0, 0.02)" in text  # BertConfig's initializer_range
        assert "xavier" not in text  # BERT has no nn.MultiheadAttention tensors: the card names only the draws made
    if mode == "mimetic":
        assert "Trockman" in card.text and "@inproceedings{trockman2023mimetic" in card.text
    assert ("no longer hold what the source model learned" in text) == get_mode(mode).fresh
    cli("verify", bert_dir, out, *source)  # what the card and record describe is what the weights hold


def test_a_mode_says_where_it_is_not_supported(tmp_path, cli):
    """mimetic writes W_O, which is not rewritten in ONNX graphs: refused in one line by the mode's own slot."""
    from helpers.cli import expect_cli_error
    from helpers.onnx_helpers import export

    folder = tmp_path / "onnx"
    folder.mkdir()
    export(tiny_bert(), "bert", folder / "model.onnx", dynamo=False)
    assert get_mode("mimetic").writes_outputs  # and ONNX weights do not rewrite whole tensors
    expect_cli_error(
        cli,
        folder,
        "reinit",
        folder / "model.onnx",
        "--mode",
        "mimetic",
        "-o",
        tmp_path / "out.onnx",
        match="--mode mimetic is not supported on these weights",
    )
    assert not (tmp_path / "out.onnx").exists()


def test_inspect_with_layout_check_and_jacobian_opens_and_detects_once(tmp_path, monkeypatch, cli):
    """`inspect --verify-layout --jacobian` reads the checkpoint once: one open, one detection, both checks on it."""
    import surgeon.api
    import surgeon.detect
    import surgeon.hub.read

    folder = tmp_path / "bert"
    tiny_bert().save_pretrained(folder)
    ids = tmp_path / "ids.pt"
    import torch

    torch.save(torch.tensor([[1, 5, 7, 9, 2]]), ids)
    calls = {"open": 0, "detect": 0}
    real_open, real_detect = surgeon.hub.read.open_model, surgeon.detect.detect_source

    def counting_open(*a, **k):
        calls["open"] += 1
        return real_open(*a, **k)

    def counting_detect(*a, **k):
        calls["detect"] += 1
        return real_detect(*a, **k)

    monkeypatch.setattr(surgeon.hub.read, "open_model", counting_open)
    monkeypatch.setattr(surgeon.api, "open_model", counting_open)  # the API's own name for it
    monkeypatch.setattr(surgeon.api, "detect_source", counting_detect)
    monkeypatch.setattr(surgeon.detect, "detect_source", counting_detect)
    result = cli("inspect", folder, "--verify-layout", "--jacobian", "--inputs", ids, "--json")
    data = json.loads(result.output)
    assert any(n.startswith("layout verified") for n in data["notes"]) and data["jacobian"]["layers"]
    assert calls == {"open": 1, "detect": 1}


def test_verify_reads_each_modes_method_and_the_legacy_one(llama_dir, tmp_path, cli):
    """A record's method must be its mode's (or 0.2.0's one name for all modes); anything else is not surgeon's."""
    from helpers.records import edit_last, rewrite_record

    src, out = llama_dir / "model.safetensors", tmp_path / "polar.safetensors"
    cli("reinit", src, "--mode", "polar", "--layers", "0", "-o", out)
    assert cli("verify", src, out).stdout.startswith("verified:")
    rewrite_record(out, edit_last(lambda r: r.update(method="conditioned-initialization")))  # as 0.2.0 wrote it
    assert cli("verify", src, out).stdout.startswith("verified:")
    rewrite_record(out, edit_last(lambda r: r.update(method="mimetic-initialization")))
    result = cli("verify", src, out, ok=False)
    assert result.exit_code == 1 and "says method 'mimetic-initialization' for mode polar" in result.stderr


def test_the_mode_supplies_what_it_writes_besides_qkv(bert_dir):
    """The planner asks the mode for its extra tensors (mimetic's W_O), the engine asks it for their values;
    the other modes write none. The plan that carries them is frozen."""
    import torch

    from surgeon.compute.engine import Engine
    from surgeon.detect import detect_source
    from surgeon.open.source import open_source
    from surgeon.plan.planner import prepare_checkpoint

    source = open_source(bert_dir)
    detection = detect_source(source)
    shapes = {n: t.shape for n, t in source.primary.tensors.items()}
    plan = prepare_checkpoint(source, detection, ReinitOptions(mode="mimetic", layers="0"))
    mimetic = get_mode("mimetic")
    assert plan.outputs == mimetic.find_outputs(dataclasses.replace(plan, outputs={}), shapes)
    ((module, (w_o, linear)),) = plan.outputs.items()
    assert w_o == f"{module.rsplit('.', 1)[0]}.output.dense.weight" and w_o in plan.tensors() and linear
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.outputs = {}  # type: ignore[misc]

    v = next(c for c in plan.changes if c.role == "v")
    new = Engine(plan, torch.device("cpu")).update(w_o, source.primary.read(w_o), record=False)
    drawn = mimetic.draw_output(v, plan.options, key=v.projection.weight.tensor, linear=linear)
    assert torch.equal(new, drawn.to(new.dtype))
    for mode in ("conditioned", "polar", "redraw"):
        other = prepare_checkpoint(source, detection, ReinitOptions(mode=mode, layers="0"))
        assert other.outputs == {} == get_mode(mode).find_outputs(other, shapes)
        with pytest.raises(NotImplementedError):
            get_mode(mode).draw_output(v, other.options, key="k", linear=True)
