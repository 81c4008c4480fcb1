"""The error hierarchy: one root, documented branches, causes kept."""

from __future__ import annotations

import inspect

import pytest

from phalanx.api import errors


def _error_classes() -> list[type[BaseException]]:
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BaseException)]


def test_every_error_derives_from_phalanx_error() -> None:
    classes = _error_classes()
    assert len(classes) >= 10
    for cls in classes:
        assert issubclass(cls, errors.PhalanxError), cls


def test_the_module_docstring_draws_every_class() -> None:
    doc = errors.__doc__ or ""
    for cls in _error_classes():
        assert cls.__name__ in doc, f"{cls.__name__} missing from the tree in the docstring"


@pytest.mark.parametrize(
    ("child", "parent"),
    [
        (errors.RendezvousClosedError, errors.RendezvousError),
        (errors.RendezvousTimeoutError, errors.RendezvousError),
        (errors.CheckpointCorruptError, errors.CheckpointError),
        (errors.PersistError, errors.CheckpointError),
        (errors.LaunchError, errors.WorkerError),
    ],
)
def test_branches(child: type[Exception], parent: type[Exception]) -> None:
    assert issubclass(child, parent)


def test_causes_are_chained() -> None:
    def load() -> None:
        try:
            raise OSError(28, "No space left on device")
        except OSError as exc:
            raise errors.PersistError("persisting step 7 failed: the disk is full") from exc

    with pytest.raises(errors.PersistError) as info:
        load()
    assert isinstance(info.value.__cause__, OSError)
    assert "disk is full" in str(info.value)
