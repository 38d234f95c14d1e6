"""File outputs stay files: an .onnx with external data written as ``-o PATH.onnx`` is PATH.onnx with
its data files beside it (renamed after it, locations rewritten), nothing else written; a folder
output only when the user names a folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from surgeon import reinit_checkpoint
from surgeon.errors import OutputError

from helpers.digests import tree_digest
from helpers.families import FAMILIES
from helpers.onnx_helpers import check_against_pytorch, export, initializers, ort_run, save_variant, torch_forward


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT (legacy exporter), its inputs, parameters and initializers."""
    model = FAMILIES["bert"].make()
    path = tmp_path_factory.mktemp("bert") / "embedded.onnx"
    feeds = export(model, "bert", path, dynamo=False)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return model, path, feeds, params, initializers(path)


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("kind", ["one-file", "split"])
def test_onnx_output_with_external_data_is_a_file_with_its_data_beside_it(bert, cli, tmp_path, kind):
    model, embedded, feeds, params, inits = bert
    src = save_variant(embedded, tmp_path / "src", kind)
    before = tree_digest(src.parent)
    out = tmp_path / "dest" / "out.onnx"
    reinit_checkpoint(src, output=out, layers="1", device="cpu")
    assert tree_digest(src.parent) == before
    expected = {"out.onnx.data"} if kind == "one-file" else {f"out.onnx.weights_part{i}.bin" for i in range(3)}
    assert files_under(tmp_path / "dest") == {"out.onnx", *expected}  # nothing else, no folder named out.onnx
    assert out.is_file()
    # locations are relative to the new file
    locations = {
        e.value
        for t in onnx.load(str(out), load_external_data=False).graph.initializer
        for e in t.external_data
        if e.key == "location"
    }
    assert locations == expected
    new = initializers(out)  # onnx.load reads the data through the new locations
    chosen = lambda tb: tb.module.startswith("encoder.layer.1.")  # noqa: E731
    _, reference = check_against_pytorch(model, params, inits, new, chosen)  # every other initializer byte-identical
    got = ort_run(out, feeds)
    np.testing.assert_allclose(got, torch_forward(reference, feeds), atol=1e-4, rtol=1e-4)
    assert not np.allclose(got, torch_forward(model, feeds), atol=1e-4)
    assert "verified" in cli("verify", src, out).output


def test_onnx_output_beside_the_input_and_the_default(bert, tmp_path):
    model, embedded, feeds, params, inits = bert
    src = save_variant(embedded, tmp_path / "src", "one-file")
    before = tree_digest(src.parent)
    reinit_checkpoint(src, output=src.parent / "out.onnx", layers="0", device="cpu")
    reinit_checkpoint(src, layers="0", device="cpu")  # default: model.reinit.onnx beside the input
    assert files_under(src.parent) == {
        "model.onnx",
        "model.onnx.data",
        "out.onnx",
        "out.onnx.data",
        "model.reinit.onnx",
        "model.reinit.onnx.data",
    }
    assert {k: v for k, v in tree_digest(src.parent).items() if k in before} == before
    assert initializers(src.parent / "out.onnx").keys() == inits.keys()
    a, b = initializers(src.parent / "out.onnx"), initializers(src.parent / "model.reinit.onnx")
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)
    ort_run(src.parent / "model.reinit.onnx", feeds)


def test_a_named_folder_is_a_folder(bert, tmp_path):
    src = save_variant(bert[1], tmp_path / "src", "one-file")
    out = tmp_path / "folder-out"
    reinit_checkpoint(src, output=out, layers="0", device="cpu")
    assert out.is_dir() and {"model.onnx", "model.onnx.data"} <= files_under(out)
    ort_run(out / "model.onnx", bert[2])


def test_existing_data_file_is_refused_and_nothing_written(bert, tmp_path):
    src = save_variant(bert[1], tmp_path / "src", "one-file")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "out.onnx.data").write_bytes(b"someone else's")
    with pytest.raises(OutputError, match="out.onnx.data already exists"):
        reinit_checkpoint(src, output=dest / "out.onnx", layers="0", device="cpu")
    assert files_under(dest) == {"out.onnx.data"} and (dest / "out.onnx.data").read_bytes() == b"someone else's"
    reinit_checkpoint(src, output=dest / "out.onnx", layers="0", device="cpu", overwrite=True)
    assert files_under(dest) == {"out.onnx", "out.onnx.data"}
    ort_run(dest / "out.onnx", bert[2])


def test_help_and_docstrings_name_onnx(cli):
    from surgeon import api

    for args in ([], ["reinit"], ["inspect"]):
        assert "onnx" in cli(*args, "--help").output.lower(), args
    assert "out.onnx.data" in cli("reinit", "--help").output
    assert "ONNX" in (api.reinit_checkpoint.__doc__ or "") and "ONNX" in (api.inspect_checkpoint.__doc__ or "")


def test_a_push_needs_a_folder(bert, tmp_path):
    from surgeon.open.source import open_source
    from surgeon.write.output import OutputKind, resolve_destination

    source = open_source(save_variant(bert[1], tmp_path / "src", "one-file"))
    with pytest.raises(OutputError, match="uploads a model folder"):
        resolve_destination(source, tmp_path / "out.onnx", in_place=False, overwrite=False, push=True)
    pushed = resolve_destination(source, None, in_place=False, overwrite=False, push=True)
    assert (pushed.path, pushed.kind, pushed.companions) == (tmp_path / "src-reinit", OutputKind.FOLDER, ())
    beside = resolve_destination(source, None, in_place=False, overwrite=False)
    assert (beside.path, beside.kind) == (tmp_path / "src" / "model.reinit.onnx", OutputKind.FILES)
    assert [p.name for p in beside.companions] == ["model.reinit.onnx.data"]


def test_saving_without_a_write_plan_is_refused(bert, tmp_path):
    """The copies of shared initializers are decided by write_plan and handed to the save; a save without
    one fails loudly instead of writing a shared initializer's new values for every reader."""
    from surgeon.open.source import open_source

    weights = open_source(bert[1]).primary
    with pytest.raises(TypeError, match="write_plan"):
        weights.save(tmp_path, lambda file: iter(()), {})  # type: ignore[call-arg]
    assert not list(tmp_path.iterdir())
