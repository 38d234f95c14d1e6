"""Errors are their builtin kind too (``except ValueError`` works) and pickle with every field."""

from __future__ import annotations

import pickle

import pytest

from surgeon import errors as E

KINDS = {
    E.CheckpointError: ValueError,
    E.UnsupportedWeightsError: ValueError,
    E.TensorParallelError: ValueError,
    E.NoAttentionFoundError: LookupError,
    E.LayoutError: ValueError,
    E.SelectionError: ValueError,
    E.SharedInitializerError: ValueError,
    E.OptionError: ValueError,
    E.OutputError: OSError,
    E.HalfPatchedError: OSError,
    E.HubError: OSError,
    E.HubOfflineError: ConnectionError,
    E.HubAccessError: PermissionError,
    E.HubNotFoundError: FileNotFoundError,
    E.HubAuthError: PermissionError,
    E.PushError: OSError,
    E.VerificationError: ValueError,
    E.DerivedMismatch: ValueError,
    E.RankFailed: RuntimeError,
    E.DependencyError: ImportError,
}


def test_every_error_class_is_listed():
    classes = {
        c for c in vars(E).values() if isinstance(c, type) and issubclass(c, E.SurgeonError) and c is not E.SurgeonError
    }
    assert classes == set(KINDS)


@pytest.mark.parametrize("cls", list(KINDS), ids=lambda c: c.__name__)
def test_builtin_kind_and_pickle(cls):
    extra = {"uploaded": ["a"], "not_uploaded": ["b"]} if cls is E.PushError else {}
    exc = cls(
        f"bad {E.opt('num_heads', 4)}", tensor="w", path="/x/model.safetensors", context="while reading: ", **extra
    )
    assert isinstance(exc, KINDS[cls]) and isinstance(exc, E.SurgeonError)
    with pytest.raises(KINDS[cls]):
        raise exc
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == str(exc) == "while reading: bad num_heads=4"
    assert (back.tensor, back.path, back.context, back.options, back.exit_code) == (
        "w",
        "/x/model.safetensors",
        "while reading: ",
        ("num_heads",),
        exc.exit_code,
    )
    if extra:
        assert (back.uploaded, back.not_uploaded) == (["a"], ["b"])


def test_an_interrupted_half_patch_exits_as_sigint_does():
    exc = E.HalfPatchedError("interrupted while rolling back x", interrupted=True)
    back = pickle.loads(pickle.dumps(exc))
    assert (exc.exit_code, back.exit_code, back.interrupted) == (130, 130, True)
    assert E.HalfPatchedError("failed").exit_code == 1
