"""Files that a folder's own files name (a checkpoint index, a manifest): they must stay inside that folder.

A name read from a file is joined to its folder only here. It is refused when it is absolute or
climbs with `..`, and when the file it reaches, links resolved, lies outside the folder: a link out
is followed by nothing. One layout is let through: the Hugging Face Hub cache keeps a snapshot's
files (`<repo>/snapshots/<revision>/`) as links into the same repository's `<repo>/blobs/`.
A leaf module, so the model, trainer and run readers can all use it.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from workbench.errors import CheckpointError


def _roots(real_folder: Path) -> tuple[Path, ...]:
    """Where a file of `real_folder` (resolved) may really lie."""
    repo = real_folder.parent.parent
    if real_folder.parent.name == "snapshots" and (repo / "blobs").is_dir():
        return real_folder, repo / "blobs"
    return (real_folder,)


def file_inside(folder: Path, name: object, named_by: str, fix: str) -> Path:
    """`folder/name`, checked; CheckpointError if `name` or a link on its way leads outside `folder`.

    `named_by`: what holds the name (for the message, e.g. the index file); `fix`: what the user can do.
    The file need not exist: a missing file is its reader's error, which names it.
    """
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise CheckpointError(f"{named_by} names {name!r}, which is not a file name inside {folder}; {fix}")
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(f"{named_by} names {name!r}, which points outside {folder}; {fix}")
    real_folder = folder.resolve()
    real = (real_folder / relative).resolve()
    if not any(real.is_relative_to(root) for root in _roots(real_folder)):
        raise CheckpointError(
            f"{folder / relative} leads to {real} (through a link), outside {folder}: nothing outside the "
            f"folder is read; {fix}"
        )
    return folder / relative
