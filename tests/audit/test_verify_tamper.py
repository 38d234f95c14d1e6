"""`surgeon verify` on outputs changed after surgeon made them: every kind of change is exit 3 with a line
naming it; malformed records are exit 1 with one line; genuine outputs (chains, dual formats, polar in bf16
and fp32) verify."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import surgeon
from surgeon._version import __version__
from surgeon.errors import CheckpointError
from surgeon.formats.safetensors_header import encode_header, read_header, with_metadata
from surgeon.report.record import card_records, history, parse_json, parse_record

from helpers.cli import expect_cli_error
from helpers.onnx_graphs import tiny_attention
from helpers.records import DEFAULT_OPTIONS, edit_last, rewrite_record
from helpers.tiny import tiny_llama


def _fails(cli, src, out, match: str, code: int = 3) -> str:
    """`surgeon verify src out`: one line naming ``match``, exit ``code``, nothing written."""
    line = expect_cli_error(cli, out.parent, "verify", src, out, match=match)
    assert cli("verify", src, out, ok=False).exit_code == code, line
    return line


@pytest.fixture
def made(tmp_path, llama_dir, cli):
    """A folder input with a tokenizer-like file and a card, and its genuine output."""
    (llama_dir / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (llama_dir / "README.md").write_text("# the source card\n")
    out = tmp_path / "out"
    cli("reinit", llama_dir, "--layers", "1-", "--seed", "5", "-o", out)
    assert cli("verify", llama_dir, out).stdout.startswith("verified:")
    return llama_dir, out


# --- folder outputs: every file ------------------------------------------------------------------


def test_config_and_code_files_are_compared(cli, made):
    src, out = made
    config = json.loads((out / "config.json").read_text())
    good = (out / "config.json").read_text()
    (out / "config.json").write_text(json.dumps({**config, "num_attention_heads": 4}))
    _fails(cli, src, out, "config.json differs from")
    (out / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling_evil.LlamaModel"}}))
    (out / "modeling_evil.py").write_text("import os\n")
    _fails(cli, src, out, "modeling_evil.py was added, which surgeon does not write")
    (out / "modeling_evil.py").unlink()
    _fails(cli, src, out, "config.json differs from")
    (out / "config.json").write_text(good)
    (out / "tokenizer.json").unlink()
    _fails(cli, src, out, "tokenizer.json of")
    (out / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    os.mkfifo(out / "special_tokens_map.json")  # never opened: a FIFO would hang a byte comparison
    _fails(cli, src, out, "special_tokens_map.json is not a regular file")
    (out / "special_tokens_map.json").unlink()
    # a Hub download's bookkeeping, which no loader reads, is not compared; a link to a folder is a mismatch
    (out / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (out / ".cache" / "huggingface").mkdir(parents=True)
    (out / ".cache" / "huggingface" / "config.json.metadata").write_text("x\n")
    assert cli("verify", src, out).stdout.startswith("verified:")
    (out / "extra").symlink_to(src)
    _fails(cli, src, out, "extra is a link to a folder; surgeon writes no links")


def test_the_card_must_carry_the_weights_record(cli, made):
    src, out = made
    card = (out / "README.md").read_text()
    assert "# the source card" in card
    (out / "README.md").write_text(card.replace('"seed":5', '"seed":6'))
    _fails(cli, src, out, "the record in its README.md is not the record of its weights")
    (out / "README.md").write_text("# something else\n")
    _fails(cli, src, out, "its README.md is neither surgeon's model card nor")
    (out / "README.md").unlink()
    _fails(cli, src, out, "README.md of")


def test_extra_weights_a_loader_would_read(cli, tmp_path):
    src = tmp_path / "sharded"
    tiny_llama().save_pretrained(src, max_shard_size="60KB")
    assert (src / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    cli("reinit", src, "--layers", "0", "-o", out)
    assert cli("verify", src, out).stdout.startswith("verified:")
    # the record is only in the shard that changed (the others are their source's bytes): another record put
    # into a shard that did not change is found
    holder, shard = sorted(out.glob("model-*.safetensors"))[:2]
    assert "surgeon" in read_header(holder).metadata and "surgeon" not in read_header(shard).metadata
    good = shard.read_bytes()
    other = json.loads(read_header(holder).metadata["surgeon"])
    other[-1]["options"]["seed"] = 9
    header = read_header(shard)
    raw = encode_header(with_metadata(header.entries, {**header.metadata, "surgeon": json.dumps(other)}))
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + good[header.data_start :])
    _fails(cli, src, out, f"{shard.name} holds other surgeon records than the ones verified")
    shard.write_bytes(good)
    header = read_header(shard)
    raw = encode_header(with_metadata(header.entries, {**header.metadata, "format": "tf"}))
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + good[header.data_start :])
    _fails(cli, src, out, f"the metadata of {shard.name} differs from the original's beyond surgeon's record")
    shard.write_bytes(good)
    index = (out / "model.safetensors.index.json").read_bytes()
    (out / "model.safetensors.index.json").write_bytes(index.replace(b"{", b"{ ", 1))  # the same JSON, other bytes
    _fails(cli, src, out, "model.safetensors.index.json differs from")
    (out / "model.safetensors.index.json").write_bytes(index)
    # transformers loads a model.safetensors beside the shards
    tiny_llama().save_pretrained(tmp_path / "single")
    shutil.copy(tmp_path / "single" / "model.safetensors", out / "model.safetensors")
    _fails(cli, src, out, "model.safetensors was added: weights a loader may read instead of the re-initialized ones")
    (out / "model.safetensors").unlink()
    # a .bin beside the .safetensors of a folder that had none
    torch.save(tiny_llama().state_dict(), out / "pytorch_model.bin")
    _fails(cli, src, out, "pytorch_model.bin was added: weights a loader may read")


def test_dual_format_folder(cli, tmp_path):
    src = tmp_path / "dual"
    model = tiny_llama()
    model.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    out = tmp_path / "out"
    cli("reinit", src, "--layers", "0", "-o", out)
    v = surgeon.verify(src, out)
    assert v.identical == 2 * (len(model.state_dict()) - 3)  # both formats checked
    # the .bin left as it was: it still holds the old attention weights
    shutil.copy(src / "pytorch_model.bin", out / "pytorch_model.bin")
    line = _fails(cli, src, out, "in its torch (pytorch_model.bin): ")
    assert "model.layers.0.self_attn.q_proj.weight" in line
    # a file of the original that surgeon leaves out (another copy of the weights) put back in
    shutil.rmtree(out)
    (src / "onnx").mkdir()
    (src / "onnx" / "model.onnx").write_bytes(b"an export of the old weights")
    cli("reinit", src, "--layers", "0", "-o", out)
    assert not (out / "onnx").exists()
    shutil.copytree(src / "onnx", out / "onnx")
    _fails(cli, src, out, "onnx/model.onnx is there, a file of")


def test_torch_shards_none_of_whose_tensors_change_are_copied_as_they_are(cli, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    model = tiny_llama()
    model.config.save_pretrained(src)
    state = model.state_dict()
    shards = {"pytorch_model-00001-of-00002.bin": {k: v for k, v in state.items() if ".layers.2." not in k}}
    shards["pytorch_model-00002-of-00002.bin"] = {k: v for k, v in state.items() if ".layers.2." in k}
    for name, part in shards.items():
        torch.save(part, src / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "out"
    cli("reinit", src, "--layers", "2", "-o", out)
    assert cli("verify", src, out).stdout.startswith("verified:")
    first = "pytorch_model-00001-of-00002.bin"
    torch.save(
        torch.load(out / first, weights_only=True), out / first, _use_new_zipfile_serialization=False
    )  # same tensors, other file
    _fails(cli, src, out, f"{first} differs from the original's, and surgeon copies it as it is")


# --- ONNX: the graph node for node, the copies' tensors ------------------------------------------


def _onnx_pair(cli, tmp_path, **kw):
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save_model(tiny_attention(layers=2, **kw), str(folder / "model.onnx"))
    out = tmp_path / "out.onnx"
    cli("reinit", folder / "model.onnx", "--layers", "0", "-o", out)
    assert cli("verify", folder / "model.onnx", out).stdout.startswith("verified:")
    return folder / "model.onnx", out


def _edit_onnx(path, edit):
    model = onnx.load(str(path))
    edit(model)
    onnx.save_model(model, str(path))


def test_onnx_graph_is_compared_node_for_node(cli, tmp_path):
    src, out = _onnx_pair(cli, tmp_path)
    good = out.read_bytes()
    _edit_onnx(out, lambda m: None)  # re-saved by onnx: the same model
    assert cli("verify", src, out).stdout.startswith("verified:")

    def sigmoid(m):
        for node in m.graph.node:
            if node.op_type == "Softmax":
                node.op_type = "Sigmoid"
                del node.attribute[:]

    _edit_onnx(out, sigmoid)
    _fails(cli, src, out, "is Sigmoid, the original's is Softmax")
    out.write_bytes(good)
    _edit_onnx(out, lambda m: m.graph.node.append(onnx.helper.make_node("Identity", ["x"], ["y2"])))
    _fails(cli, src, out, "its graph has")
    out.write_bytes(good)
    _edit_onnx(
        out, lambda m: m.graph.output.append(onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None))
    )
    _fails(cli, src, out, "graph output 1 ('x') differs")
    out.write_bytes(good)

    def half_input(m):
        m.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16

    _edit_onnx(out, half_input)
    _fails(cli, src, out, "graph input 0 ('x') differs")
    out.write_bytes(good)

    def opset(m):
        m.opset_import[0].version -= 1

    _edit_onnx(out, opset)
    _fails(cli, src, out, "the model's opset_import differs")
    out.write_bytes(good)
    _edit_onnx(
        out,
        lambda m: m.graph.value_info.append(onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, None)),
    )
    _fails(cli, src, out, "value info 0 ('x') differs")
    out.write_bytes(good)

    def attribute(m):
        node = next(n for n in m.graph.node if n.op_type == "Softmax")
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("axis", 1))

    _edit_onnx(out, attribute)
    _fails(cli, src, out, "has another attribute 'axis'")


def test_onnx_weights_in_constant_nodes(cli, tmp_path):
    """2-D weights kept in Constant nodes are patched in place: the re-initialized ones verify as tensors,
    every other Constant node must be the original's."""
    from helpers.families import FAMILIES
    from helpers.onnx_helpers import export, weights_as_constants

    path = tmp_path / "model.onnx"
    export(FAMILIES["bert"].make(), "bert", path, dynamo=False)
    model = weights_as_constants(onnx.load(str(path)))
    src, out = tmp_path / "consts.onnx", tmp_path / "out.onnx"
    onnx.save_model(model, str(src))
    cli("reinit", src, "--layers", "1", "-o", out)
    assert cli("verify", src, out).stdout.startswith("verified:")

    def nudge(m):  # a Constant outside the selection: its value is compared as a tensor
        node = next(n for n in m.graph.node if n.name == "const_0")
        value = onnx.numpy_helper.to_array(node.attribute[0].t)
        node.attribute[0].t.CopyFrom(onnx.numpy_helper.from_array(value + np.float32(1e-3), node.output[0]))

    _edit_onnx(out, nudge)
    _fails(cli, src, out, "is not in the recorded selection, but its bytes differ")


def test_onnx_shared_initializer_copies(cli, tmp_path):
    src, out = _onnx_pair(cli, tmp_path, share_q=True)
    record = json.loads(next(p.value for p in onnx.load(str(out)).metadata_props if p.key == "surgeon"))[-1]
    assert record["copies"] == {"q_shared": "q_shared.surgeon_copy"}
    good = out.read_bytes()

    def tensor(m, name):
        return next(t for t in m.graph.initializer if t.name == name)

    # the original shared initializer, kept for the other layer, must be byte-identical
    def nudge_shared(m):
        t = tensor(m, "q_shared")
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) + np.float32(1e-3), "q_shared"))

    _edit_onnx(out, nudge_shared)
    _fails(cli, src, out, "tensor 'q_shared' is not in the recorded selection, but its bytes differ")
    out.write_bytes(good)

    # the copy's values are re-derived
    def nudge_copy(m):
        t = tensor(m, "q_shared.surgeon_copy")
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * np.float32(2), t.name))

    _edit_onnx(out, nudge_copy)
    _fails(cli, src, out, "tensor 'q_shared.surgeon_copy': element")
    out.write_bytes(good)

    # layer 1 made to read the copy too
    def redirect(m):
        for node in m.graph.node:
            node.input[:] = ["q_shared.surgeon_copy" if x == "q_shared" else x for x in node.input]

    _edit_onnx(out, redirect)
    line = _fails(cli, src, out, "(/layers.1/attn/q_proj/MatMul) has inputs")
    assert "'q_shared.surgeon_copy'], surgeon's would be [" in line
    out.write_bytes(good)

    # the record lies about the copy's name
    def rename(m):
        for p in m.metadata_props:
            if p.key == "surgeon":
                records = json.loads(p.value)
                records[-1]["copies"] = {"q_shared": "x"}
                p.value = json.dumps(records)

    _edit_onnx(out, rename)
    _fails(cli, src, out, "its record lists the copies {'q_shared': 'x'}, and the recorded plan needs")
    # a folder output with external data: the card carries the record without the copies the writer added
    ext = tmp_path / "ext"
    ext.mkdir()
    onnx.save_model(
        tiny_attention(layers=2, share_q=True),
        str(ext / "model.onnx"),
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=256,
    )
    cli("reinit", ext, "--layers", "0", "-o", tmp_path / "ext-out")
    assert cli("verify", ext, tmp_path / "ext-out").stdout.startswith("verified:")
    cli("reinit", ext / "model.onnx", "--layers", "0", "-o", tmp_path / "ext-out.onnx")  # data files renamed beside it
    assert (tmp_path / "ext-out.onnx.data").is_file()
    assert cli("verify", ext / "model.onnx", tmp_path / "ext-out.onnx").stdout.startswith("verified:")


# --- polar: one ulp of the dtype ----------------------------------------------------------------


def _shift(path, name, ulps: int, dtype) -> float:
    """Move the largest selected element of tensor ``name`` by ``ulps`` units in the last place (same binade)."""
    header = read_header(path)
    begin, end = header.entries[name]["data_offsets"]
    data = bytearray(path.read_bytes())
    start = header.data_start + begin
    values = torch.frombuffer(bytearray(data[start : start + end - begin]), dtype=dtype).clone()
    bits = values.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    i = int(values[:8].double().abs().argmax())  # a row of head 0, layer 0's q: re-initialized
    before = values[i].item()
    bits[i] += ulps if before > 0 else -ulps  # away from zero: the bit pattern counts ulps
    assert torch.frexp(values[i : i + 1].double())[1] == torch.frexp(torch.tensor([before], dtype=torch.float64))[1]
    data[start : start + end - begin] = values.view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))
    return before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_polar_bound_is_one_ulp(cli, tmp_path, dtype):
    src = tmp_path / "llama"
    tiny_llama().to(dtype).save_pretrained(src)
    out = tmp_path / "polar"
    cli("reinit", src, "--mode", "polar", "--layers", "0", "-o", out)
    assert "within the dtype's rounding (1 ulp)" in cli("verify", src, out).stdout
    file, name = out / "model.safetensors", "model.layers.0.self_attn.q_proj.weight"
    good = file.read_bytes()
    _shift(file, name, 1, dtype)  # one ulp: what another machine's float64 SVD may round to
    assert cli("verify", src, out).stdout.startswith("verified:")
    file.write_bytes(good)
    _shift(file, name, 2, dtype)
    line = _fails(cli, src, out, "polar conditioning of the original gives")
    assert f"(2 ulps of {dtype} off, beyond {dtype} rounding: 1 ulp)" in line
    file.write_bytes(good)
    _shift(file, name, 7, dtype)  # the ~15 half-ulps that passed before
    _fails(cli, src, out, "ulps of")


@pytest.mark.parametrize("family", ["gpt2", "bloom", "t5"])  # Conv1D (transposed), fused interleaved, cross-attention
def test_genuine_polar_outputs_of_other_layouts_verify(cli, saved_family, tmp_path, family):
    src, _ = saved_family(family)
    out = tmp_path / "polar"
    cli("reinit", src, "--mode", "polar", "--strength", "0.5", "--heads", "0", "-o", out)
    assert cli("verify", src, out).stdout.startswith("verified:")
    cli("reinit", src, "--mode", "polar", "-o", out, "--overwrite")
    assert cli("verify", src, out).stdout.startswith("verified:")


# --- chains and versions --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_chain_verifies_against_the_last_record(cli, tmp_path, fmt):
    a = tmp_path / "A"
    model = tiny_llama()
    if fmt == "safetensors":
        model.save_pretrained(a)
    else:
        a.mkdir()
        model.config.save_pretrained(a)
        torch.save(model.state_dict(), a / "pytorch_model.bin")
    cli("reinit", a, "--layers", "0", "-o", tmp_path / "B")
    cli("reinit", tmp_path / "B", "--layers", "1", "--seed", "3", "-o", tmp_path / "C")
    card = (tmp_path / "C" / "README.md").read_text()
    assert len(card_records(card)) == 1  # its own record; B's, in the source card, escaped (the source's)
    assert card.count("&lt;!-- surgeon-record {") == 1
    assert cli("verify", tmp_path / "B", tmp_path / "C").stdout.startswith(
        f"verified: {tmp_path / 'C'} is {tmp_path / 'B'} with 1 attention block"
    )
    assert cli("verify", a, tmp_path / "B").stdout.startswith("verified:")
    assert cli("verify", a, tmp_path / "C", ok=False).exit_code == 3  # C is not A with one run


def test_another_versions_output_says_so(cli, made):
    src, out = made
    file = out / "model.safetensors"
    good = file.read_bytes()
    card = (out / "README.md").read_text()
    (out / "README.md").write_text(card.replace(f'"version":"{__version__}"', '"version":"0.1.0"'))
    rewrite_record(file, edit_last(lambda r: r.update(version="0.1.0")))
    assert "(made by surgeon 0.1.0)" in cli("verify", src, out).stdout  # the same values: verified, and said
    rewrite_record(file, edit_last(lambda r: r["options"].update(seed=6)))
    line = _fails(
        cli,
        src,
        out,
        f"it was made by surgeon 0.1.0, and this is surgeon {__version__}, whose records and draws may differ",
        code=1,
    )
    assert "verify it with surgeon 0.1.0" in line and "element" in line
    # bytes that no version changes are a mismatch whatever the version
    rewrite_record(file, edit_last(lambda r: r["options"].update(seed=5)))
    header = read_header(file)
    data = bytearray(file.read_bytes())
    data[header.data_start + header.entries["model.embed_tokens.weight"]["data_offsets"][0]] ^= 1
    file.write_bytes(bytes(data))
    _fails(cli, src, out, "tensor 'model.embed_tokens.weight' is not in the recorded selection")
    # a record this version cannot read: says which version wrote it
    file.write_bytes(good)
    rewrite_record(file, edit_last(lambda r: r.update(version="0.1.0", options={**r["options"], "old_option": 1})))
    _fails(cli, src, out, "it was made by surgeon 0.1.0", code=1)


# --- malformed records: exit 1, one line ------------------------------------------------------------

MALFORMED = [
    (edit_last(lambda r: r["options"].update(seed="5")), "option seed is '5'"),
    (edit_last(lambda r: r["options"].update(seed=True)), "option seed is True"),
    (edit_last(lambda r: r["options"].update(targets=["x"])), "option targets is ['x']"),
    (edit_last(lambda r: r["options"].update(strength=7.0)), "option strength is 7.0"),
    (edit_last(lambda r: r["options"].update(heads=[1, "2"])), "option heads is [1, '2']"),
    (edit_last(lambda r: r["options"].update(layers=2**40)), "option layers is"),
    (edit_last(lambda r: r["options"].update(layers="9" * 5000)), "option layers is '99999"),
    (edit_last(lambda r: r["options"].pop("mode")), "has no 'mode'"),
    (edit_last(lambda r: r.update(options=[1])), "has 'options' as a list, not dict"),
    (edit_last(lambda r: r.update(blocks={"a": 1})), "has 'blocks' as an object, not list"),
    (edit_last(lambda r: r["blocks"][0].update(layer="1")), "block 0 of the last surgeon record has layer '1'"),
    (edit_last(lambda r: r["blocks"][0].update(targets={"q": 1})), "has targets surgeon never records"),
    (edit_last(lambda r: r.update(extra=1)), "has a field surgeon does not write ('extra')"),
    (edit_last(lambda r: r.update(tool="other")), "names tool 'other'"),
    (edit_last(lambda r: r.update(version=None)), "has no readable version (None)"),
    (lambda records: [1, 2], "the last surgeon record is a number, not a record"),
    (lambda records: [], "surgeon's record is a list, not a list of records"),
    (lambda records: "not json", "surgeon's record is not valid JSON"),
    (lambda records: "[" * 100_000, "not valid JSON (nested too deeply)"),
    (lambda records: "1" * 5000, "not valid JSON"),
]


@pytest.mark.parametrize("edit,match", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_records_are_one_line(cli, tmp_path, llama_dir, edit, match):
    out = tmp_path / "out.safetensors"
    cli("reinit", llama_dir / "model.safetensors", "--layers", "1", "-o", out)
    rewrite_record(out, edit)
    _fails(cli, llama_dir / "model.safetensors", out, match, code=1)


def test_malformed_card_and_onnx_records(cli, tmp_path):
    src, out = _onnx_pair(cli, tmp_path)

    def copies_as_list(m):
        for p in m.metadata_props:
            if p.key == "surgeon":
                records = json.loads(p.value)
                records[-1]["copies"] = ["q"]
                p.value = json.dumps(records)

    _edit_onnx(out, copies_as_list)
    _fails(cli, src, out, "has 'copies' as a list, not dict", code=1)
    _edit_onnx(out, lambda m: m.metadata_props.append(onnx.StringStringEntryProto(key="surgeon", value="[]")))
    _fails(cli, src, out, "hold 2 surgeon records where surgeon writes one", code=1)
    folder = tmp_path / "bin"
    model = tiny_llama()
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    cli("reinit", folder, "--layers", "0", "-o", tmp_path / "bin-out")
    card = tmp_path / "bin-out" / "README.md"
    card.write_text(card.read_text().replace('"seed":0', '"seed":"zero"'))
    _fails(cli, folder, tmp_path / "bin-out", "option seed is 'zero'", code=1)


# --- the record reader, fuzzed --------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_GENUINE = {
    "tool": "surgeon",
    "version": __version__,
    "method": "conditioned-initialization",
    "options": {**DEFAULT_OPTIONS, "layers": "1"},
    "blocks": [
        {
            "module": "model.layers.1.self_attn",
            "stack": "model.layers",
            "layer": 1,
            "kind": "self",
            "targets": {"q": "all"},
        }
    ],
}


@st.composite
def records(draw):
    """Genuine records with one field (top level, option or block field) replaced by arbitrary JSON, or dropped."""
    record = json.loads(json.dumps(_GENUINE))
    where = draw(st.sampled_from([record, record["options"], record["blocks"][0]]))
    key = draw(st.sampled_from(sorted(where) + ["new"]))
    if draw(st.booleans()):
        where[key] = draw(_json)
    else:
        where.pop(key, None)
    return record


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(records(), _json))
def test_record_reader_fuzz(value):
    try:
        found = parse_record(value, "out")
    except CheckpointError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("out")
        return
    assert isinstance(found.options.seed, int) and found.options.mode in ("conditioned", "polar", "redraw", "mimetic")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60) | st.sampled_from(["[" * 5000, '{"a": 1}', "[]", "null", "1e999", "NaN"]))
def test_record_json_and_card_fuzz(text):
    try:
        history(parse_json(text, "out"), "out")
    except CheckpointError as exc:
        assert "\n" not in str(exc)
    try:
        found = card_records(f"x <!-- surgeon-record {{{text}}} --> y <!-- surgeon-record {text}")
    except CheckpointError as exc:
        assert "\n" not in str(exc)
    else:
        assert all(isinstance(r, (dict, list, str, int, float, bool)) or r is None for r in found)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(record=records())
def test_verify_on_fuzzed_records(tmp_path_factory, record):
    """Through the whole of surgeon.verify on a real output: a verdict or a one-line SurgeonError, nothing else."""
    base = tmp_path_factory.getbasetemp() / "fuzzed"
    if not (base / "out.safetensors").is_file():
        base.mkdir(exist_ok=True)
        tiny_llama().save_pretrained(base / "src")
        surgeon.reinit_checkpoint(
            base / "src" / "model.safetensors", output=base / "out.safetensors", layers="1", device="cpu"
        )
    work = base / "work.safetensors"
    shutil.copy(base / "out.safetensors", work)
    rewrite_record(work, lambda records: [record])
    try:
        surgeon.verify(base / "src" / "model.safetensors", work)
    except surgeon.SurgeonError as exc:
        assert "\n" not in str(exc)
