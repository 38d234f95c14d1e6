"""DCP (torch.distributed.checkpoint) folders as a format: read, re-initialized, written, verified.

Checkpoints are made by ``dcp.save`` of a tiny transformers Llama (model-only, a full training state with
AdamW state and a non-tensor train state, and 2 gloo ranks under FSDP2); results are judged by torch's own
``dcp.load`` into a fresh model and that model's forward (``_observe``), and by the bytes torch's own reader
locates. Hostile folders prove that reading runs nothing from the folder (a marker file a payload would
touch) and reads nothing outside it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from helpers import dcp as dcp_helpers
from helpers.cli import Cli, expect_cli_error
from helpers.digests import tree_digest
from helpers.observe import observe
from helpers.tiny import tiny_llama

Q = "model.layers.{}.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """(a full training state saved by dcp.save with config.json beside it, surgeon's reinit of it)."""
    base = tmp_path_factory.mktemp("full")
    model = tiny_llama()
    src = dcp_helpers.save(dcp_helpers.training_state(model), base / "step-1", model.config)
    Cli()("reinit", src, "-o", base / "out")
    return src, base / "out", model


def test_full_training_state_loads_back_with_conditioned_heads(full, cli, one_thread):
    src, out, trained = full
    model, opt = dcp_helpers.fresh(), None
    state = {"model": model.state_dict(), "optim": {}, "train_state": {"step": 0, "tokens_seen": 0}}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids, labels=ids).loss.backward()
    opt.step()  # so the optimizer has state to load into
    state["model"], state["optim"] = get_state_dict(model, opt)
    dcp_helpers.load(state, out)
    model.load_state_dict(state["model"])
    assert state["train_state"] == {"step": 1, "tokens_seen": 4}
    maps, before = observe(model), observe(trained)
    assert len(maps) == 3
    for name in maps:
        dcp_helpers.conditioned(maps[name])
        assert not torch.allclose(maps[name].q, before[name].q, atol=1e-3)
    # same keys and chunking, and every item but the re-initialized q/k/v byte for byte as dcp.save wrote it
    a, b = dcp_helpers.spans(src), dcp_helpers.spans(out)
    assert a.keys() == b.keys()
    assert (src / ".metadata").read_bytes() == (out / ".metadata").read_bytes()
    changed = {k for k in a if a[k] != b[k]}
    assert {k[0] for k in changed} == {
        f"model.model.layers.{i}.self_attn.{p}_proj.weight" for i in range(3) for p in "qkv"
    }
    others = [k for k in a if k[0].startswith(("optim.", "train_state."))]
    assert len(others) > 50 and not changed & set(others)  # AdamW state and the train state: untouched
    out_model = {k: v for k, v in model.state_dict().items() if "_proj" not in k or "o_proj" in k or "mlp" in k}
    for k, v in out_model.items():
        assert torch.equal(v, trained.state_dict()[k]), k
    line = cli("verify", src, out).stdout
    assert line.startswith("verified:") and "9 changed tensors" in line


def test_inspect_names_what_it_carries(full, cli):
    src, _, _ = full
    shown = cli("inspect", src).stdout
    assert "3 attention blocks" in shown and "q_proj.weight" in shown
    assert "model tensors under 'model'" in shown and "carried over byte for byte" in shown


def test_model_only_one_layer_heads_from_hints(tmp_path, cli, one_thread):
    model = tiny_llama()
    src = dcp_helpers.save(model.state_dict(), tmp_path / "ckpt")  # no config.json: heads from the hints
    expect_cli_error(cli, src, "reinit", src, "-o", tmp_path / "x", match="--num-heads")
    cli("reinit", src, "-o", tmp_path / "out", "--layers", "1", "--num-heads", "8", "--num-kv-heads", "2")
    loaded = dcp_helpers.fresh()
    sd = loaded.state_dict()
    dcp_helpers.load(sd, tmp_path / "out")
    loaded.load_state_dict(sd)
    maps, before = observe(loaded), observe(model)
    dcp_helpers.conditioned(maps["model.layers.1.self_attn"])
    for i in (0, 2):
        dcp_helpers.same_maps(maps[f"model.layers.{i}.self_attn"], before[f"model.layers.{i}.self_attn"])
    cli("verify", src, tmp_path / "out", "--num-heads", "8", "--num-kv-heads", "2")


def test_fsdp2_two_ranks_read_in_one_process(tmp_path, cli, one_thread):
    """2 gloo ranks save their shards (every parameter cut in two along dim 0, one file per rank); surgeon in
    one process writes both files, and the result equals that of the same model saved by one process."""
    from helpers.distributed import spawn

    torch.save(tiny_llama().state_dict(), tmp_path / "state.pt")
    spawn(dcp_helpers.fsdp_save_worker, 2, tmp_path, str(tmp_path / "state.pt"), str(tmp_path / "fsdp"))
    src = tmp_path / "fsdp"
    tiny_llama().config.save_pretrained(src)
    assert sorted(p.name for p in src.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    md = dcp_helpers.metadata(src)
    assert len(md.state_dict_metadata["model." + Q.format(0)].chunks) == 2
    one = dcp_helpers.save({"model": tiny_llama().state_dict()}, tmp_path / "one", tiny_llama().config)
    cli("reinit", src, "-o", tmp_path / "fsdp-out")
    cli("reinit", one, "-o", tmp_path / "one-out")
    a, b = dcp_helpers.fresh(), dcp_helpers.fresh()
    sa, sb = {"model": a.state_dict()}, {"model": b.state_dict()}
    dcp_helpers.load(sa, tmp_path / "fsdp-out")
    dcp_helpers.load(sb, tmp_path / "one-out")
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k  # 2 ranks' files = 1 process, bit for bit
    a.load_state_dict(sa["model"])
    for block in observe(a).values():
        dcp_helpers.conditioned(block)
    spans, out = dcp_helpers.spans(src), dcp_helpers.spans(tmp_path / "fsdp-out")
    moved = {f for k in spans if spans[k] != out[k] for f in [spans[k][0]]}
    assert moved == {"__0_0.distcp", "__1_0.distcp"}  # each rank's chunk of a projection, in its own file
    cli("verify", src, tmp_path / "fsdp-out")


@pytest.mark.parametrize(
    "inner", ["checkpoint/step-10", "step10/model_and_optim", "iter_0000010"], ids=["torchtitan", "olmo", "megatron"]
)
def test_a_parent_folder_names_the_dcp_folder(tmp_path, cli, inner):
    model = tiny_llama()
    run = tmp_path / "run"
    dcp_folder = dcp_helpers.save(model.state_dict(), run / inner, model.config)
    parent = dcp_folder.parent if inner != "step10/model_and_optim" else run / "step10"
    line = expect_cli_error(cli, run, "inspect", parent, match=str(dcp_folder))
    assert "DCP checkpoint" in line and "point surgeon at that folder" in line
    expect_cli_error(cli, run, "reinit", run, match=str(dcp_folder))


def test_megatron_side_file_is_carried_never_loaded(tmp_path, cli):
    """Megatron's iter_N/ keeps common.pt (a pickle of the run's arguments) beside the .distcp files: it is
    copied as it is and never unpickled (this one would run code)."""
    model = tiny_llama()
    folder = dcp_helpers.save(model.state_dict(), tmp_path / "iter_0000010", model.config)
    marker = tmp_path / "ran"
    torch.save({"args": dcp_helpers.Payload(marker)}, folder / "common.pt")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    cli("inspect", folder)
    cli("reinit", folder, "-o", tmp_path / "out")
    cli("verify", folder, tmp_path / "out")
    for name in ("common.pt", "metadata.json"):
        assert (tmp_path / "out" / name).read_bytes() == (folder / name).read_bytes()
    assert not marker.exists()
    torch.load(folder / "common.pt", weights_only=False)  # the payload is live: a plain load runs it
    assert marker.exists()


def test_metadata_that_calls_a_function_runs_nothing(full, tmp_path, cli):
    src, out, _ = full
    marker = tmp_path / "ran"
    bad = dcp_helpers.copy(src, tmp_path / "bad")
    dcp_helpers.rewrite_metadata(bad, lambda md: md.planner_data.update(hook=dcp_helpers.Payload(marker)))
    for args in (("inspect", bad), ("reinit", bad, "-o", tmp_path / "o"), ("verify", bad, out), ("verify", src, bad)):
        line = expect_cli_error(cli, bad, *args, match="asks for posix.system")
        assert "without running code" in line
    assert not marker.exists() and not (tmp_path / "o").exists()
    dcp_helpers.metadata(bad)  # torch's own reader: a bare pickle.load
    assert marker.exists()  # the payload is live


def test_byte_entry_that_calls_a_function_is_carried_untouched(tmp_path, cli):
    model = tiny_llama()
    marker = tmp_path / "ran"
    src = dcp_helpers.save(dcp_helpers.training_state(model, marker), tmp_path / "ckpt", model.config)
    assert not marker.exists()
    cli("inspect", src)
    cli("reinit", src, "-o", tmp_path / "out")
    cli("verify", src, tmp_path / "out")
    assert not marker.exists()
    a, b = dcp_helpers.spans(src), dcp_helpers.spans(tmp_path / "out")
    assert b[("train_state.hook", None)] == a[("train_state.hook", None)]
    dcp_helpers.load({"train_state": {"hook": None}}, tmp_path / "out")  # torch's default planner unpickles it
    assert marker.exists()


def _path_out(folder: Path, outside: Path) -> None:
    (outside / "x.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())  # readable, were it read
    dcp_helpers.rewrite_metadata(
        folder, lambda md: dcp_helpers.move_chunk(md, "model." + Q.format(0), relative_path="../x.distcp")
    )


def _link_out(folder: Path, outside: Path) -> None:
    (outside / "x.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    (folder / "__1_0.distcp").symlink_to(outside / "x.distcp")
    dcp_helpers.rewrite_metadata(
        folder, lambda md: dcp_helpers.move_chunk(md, "model." + Q.format(0), relative_path="__1_0.distcp")
    )


def _past_end(folder: Path, outside: Path) -> None:
    size = (folder / "__0_0.distcp").stat().st_size
    dcp_helpers.rewrite_metadata(
        folder, lambda md: dcp_helpers.move_chunk(md, "model." + Q.format(0), offset=size - 100)
    )


def _huge(folder: Path, outside: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    def edit(md):
        key = "model." + Q.format(0)
        entry = md.state_dict_metadata[key]
        (index,) = [i for i in md.storage_data if i.fqn == key]
        entry.size = torch.Size([10**6, 10**6])
        entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([10**6, 10**6]))]
        md.storage_data[MetadataIndex(key, torch.Size([0, 0]))] = md.storage_data.pop(index)

    dcp_helpers.rewrite_metadata(folder, edit)


@pytest.mark.parametrize(
    "spoil, match",
    [
        (_path_out, "not inside the checkpoint's folder"),
        (_link_out, "is a link to"),
        (_past_end, "is stored at bytes"),
        (_huge, "claims 1000000000000 elements"),
    ],
    ids=["path-out", "link-out", "past-end", "1e12-elements"],
)
def test_hostile_layouts_are_refused_before_reading(full, tmp_path, cli, spoil, match):
    src, out, _ = full
    bad = dcp_helpers.copy(src, tmp_path / "bad")
    spoil(bad, tmp_path)
    before = tree_digest(tmp_path)
    # the folder, and its .metadata given alone (no walk of the folder runs first)
    for args in (
        ("inspect", bad),
        ("inspect", bad / ".metadata"),
        ("reinit", bad, "-o", tmp_path / "o"),
        ("verify", bad, out),
    ):
        expect_cli_error(cli, bad, *args, match=match)
    assert tree_digest(tmp_path) == before and not (tmp_path / "o").exists()


def test_hf_export_keeps_no_old_sharded_copy(tmp_path, cli):
    """torch's HF storage writer with consolidation (torchtitan's last_save_in_hf) writes the consolidated
    safetensors and, in sharded/, the ranks' shards of the same weights: those are left out, with a note."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model = tiny_llama()
    sd = model.state_dict()
    folder = tmp_path / "step-10"
    writer = HuggingFaceStorageWriter(
        path=str(folder), save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=dict.fromkeys(sd, 1)
    )
    dcp_helpers.save(sd, folder, model.config, storage_writer=writer)
    (shard,) = (folder / "sharded").glob("*.safetensors")
    assert torch.equal(load_file(shard)[Q.format(0)], sd[Q.format(0)])  # the same weights again
    report = cli("reinit", folder, "-o", tmp_path / "out").stdout
    assert "left out other copies of the weights" in report and "sharded/" in report
    assert not (tmp_path / "out" / "sharded").exists()
    (out,) = (tmp_path / "out").glob("model-*.safetensors")
    assert not torch.equal(load_file(out)[Q.format(0)], sd[Q.format(0)])
    cli("verify", folder, tmp_path / "out")


def test_safetensors_serialization_is_refused_naming_it(tmp_path, cli):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    model = tiny_llama()
    folder = tmp_path / "ckpt"
    writer = FileSystemWriter(str(folder), serialization_format=SerializationFormat.SAFETENSORS)
    dcp_helpers.save(model.state_dict(), folder, model.config, storage_writer=writer)
    expect_cli_error(cli, folder, "inspect", folder, match="not in DCP's default torch_save serialization")


def test_flattened_training_state_reads_top_level_tensors(tmp_path, cli):
    """torchtitan flattens the model's entries to the top of its state, beside "optimizer" and "train_state"."""
    model = tiny_llama()
    state = dcp_helpers.training_state(model)
    flat = {**state["model"], "optimizer": state["optim"], "train_state": state["train_state"]}
    src = dcp_helpers.save(flat, tmp_path / "step-1", model.config)
    assert "model tensors at the top level" in cli("inspect", src).stdout
    cli("reinit", src, "-o", tmp_path / "out", "--layers", "0")
    a, b = dcp_helpers.spans(src), dcp_helpers.spans(tmp_path / "out")
    assert {k[0] for k in a if a[k] != b[k]} == {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
    loaded = dcp_helpers.fresh()
    sd = loaded.state_dict()
    dcp_helpers.load(sd, tmp_path / "out")
    loaded.load_state_dict(sd)
    dcp_helpers.conditioned(observe(loaded)["model.layers.0.self_attn"])


def _spell_all(folder: Path, spelling) -> None:
    """Every storage entry's data file renamed by ``spelling(name)`` in the metadata."""

    def edit(md):
        for index, info in list(md.storage_data.items()):
            md.storage_data[index] = dataclasses.replace(info, relative_path=spelling(info.relative_path))

    dcp_helpers.rewrite_metadata(folder, edit)


def test_a_data_file_spelled_two_ways_is_one_file(tmp_path, cli, one_thread):
    """``./x`` and ``x`` name one file: read in one spelling before the overlap check, so a query chunk pointed
    (as ``./x``) at the bytes of another tensor (stored under ``x``) is refused, not written over them; a
    metadata spelling every file ``./x`` reads, writes and loads in torch as before."""
    model = tiny_llama()
    src = dcp_helpers.save(model.state_dict(), tmp_path / "ckpt", model.config)
    dotted = dcp_helpers.copy(src, tmp_path / "dotted")
    _spell_all(dotted, lambda rel: "./" + rel)
    cli("reinit", dotted, "-o", tmp_path / "out", "--layers", "0")
    loaded = dcp_helpers.fresh()
    sd = loaded.state_dict()
    dcp_helpers.load(sd, tmp_path / "out")  # torch's own loader, with the metadata's own spelling
    loaded.load_state_dict(sd)
    dcp_helpers.conditioned(observe(loaded)["model.layers.0.self_attn"])
    dcp_helpers.same_maps(observe(loaded)["model.layers.1.self_attn"], observe(model)["model.layers.1.self_attn"])
    cli("verify", dotted, tmp_path / "out")

    shared = dcp_helpers.copy(src, tmp_path / "shared")
    other = "model.layers.0.self_attn.o_proj.weight"  # the same shape as the query: an archive of the same length
    (target,) = [i for i in dcp_helpers.metadata(shared).storage_data.items() if i[0].fqn == other]

    def point_q_at_o(md):
        dcp_helpers.move_chunk(md, Q.format(0), relative_path="./" + target[1].relative_path, offset=target[1].offset)

    dcp_helpers.rewrite_metadata(shared, point_q_at_o)
    expect_cli_error(cli, tmp_path, "reinit", shared, "-o", tmp_path / "o", match="share bytes of __0_0.distcp")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["README.md", ".metadata", "config.json"])
def test_a_data_file_named_like_a_file_surgeon_writes_is_refused(tmp_path, cli, name):
    """A data file named as the model card (README.md, which also carries the record), the index (.metadata) or a
    file carried beside it would be written over in the output (torch's dcp.load of it then fails): refused before
    anything is written."""
    model = tiny_llama()
    src = dcp_helpers.save(model.state_dict(), tmp_path / "ckpt", model.config)
    if name != ".metadata":  # the data under that name too (config.json: over the folder's own)
        (src / name).write_bytes((src / "__0_0.distcp").read_bytes())
    dcp_helpers.rewrite_metadata(src, lambda md: dcp_helpers.move_chunk(md, Q.format(0), relative_path=name))
    for args in (("inspect", src), ("reinit", src, "-o", tmp_path / "out")):
        expect_cli_error(cli, tmp_path, *args, match=f"names the data file '{name}'")
    assert not (tmp_path / "out").exists()
