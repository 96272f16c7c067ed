"""Read checkpoint files without running code from them.

`torch.load(weights_only=False)` and `pickle.load` call whatever a pickle names, so a crafted
checkpoint could run code on resume. Our own files are JSON, or tensors read with
`weights_only=True`. DCP has two pickles of its own: `.metadata` (read with plain `pickle.load`
by torch 2.11 and 2.13 alike, with no safe option) and the non-tensor values inside the
`.distcp` files (optimizer hyper-parameters, read with `weights_only=False`). Both are read here
through allow-lists: `.metadata` by an unpickler that knows only DCP's metadata classes, the
values by `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError

DCP_METADATA_FILE = ".metadata"
# The classes a DCP `.metadata` pickle names (torch 2.11-2.13); nothing in them runs code when built.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def read_dcp_metadata(ckpt: Path) -> Any:
    """DCP's `.metadata` of `ckpt`, unpickled with an allow-list; CheckpointError if it names anything else."""
    path = Path(ckpt) / DCP_METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = _DcpMetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"cannot resume from {ckpt}: {path.name} is missing") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure: a damaged or crafted file
        raise CheckpointError(
            f"cannot resume from {ckpt}: {path} is not DCP metadata, refused without "
            f"loading it ({type(err).__name__}: {err}); use a checkpoint workbench wrote"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"cannot resume from {ckpt}: {path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def check_dcp_values(ckpt: Path, metadata: Any, known_files: set[str]) -> None:
    """Every DCP storage item lies in a file of `known_files`; every non-tensor value loads weights_only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        rel = str(getattr(info, "relative_path", ""))
        if rel not in known_files:
            raise CheckpointError(
                f"cannot resume from {ckpt}: {DCP_METADATA_FILE} points {index.fqn} at {rel!r}, "
                "which is not a file of this checkpoint"
            )
        if index.fqn not in byte_keys or getattr(info, "transform_descriptors", None):
            continue  # tensors load with weights_only inside DCP; transformed values: SafeLoadPlanner
        with open(Path(ckpt) / rel, "rb") as f:
            f.seek(int(info.offset))
            blob = io.BytesIO(f.read(int(info.length)))
        try:
            torch.load(blob, weights_only=True)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(
                f"cannot resume from {ckpt}: the value {index.fqn} in {Path(ckpt) / rel} is not "
                f"a plain value, refused without loading it ({type(err).__name__})"
            ) from None


def read_json(path: Path, ckpt: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint file; CheckpointError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"cannot resume from {ckpt}: {path.name} is missing") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot resume from {ckpt}: {path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"cannot resume from {ckpt}: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def load_tensors(path: Path, ckpt: Path) -> Any:
    """`torch.load(weights_only=True)`: tensors and plain containers only; CheckpointError otherwise."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"cannot resume from {ckpt}: {path.name} is missing") from None
    except Exception as err:  # noqa: BLE001 - UnpicklingError for a crafted file, RuntimeError for a torn one
        raise CheckpointError(
            f"cannot resume from {ckpt}: {path} holds more than tensors and plain values, "
            f"refused without loading it ({type(err).__name__})"
        ) from None


def safe_dcp_reader_and_planner(ckpt: Path) -> tuple[Any, Any]:
    """A FileSystemReader and a load planner for `dcp.load` that never unpickle beyond the allow-lists."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_dcp_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as err:  # noqa: BLE001
                raise CheckpointError(
                    f"cannot resume from {ckpt}: the value {read_item.dest_index.fqn} in its "
                    f".distcp files is not a plain value, refused without loading it "
                    f"({type(err).__name__})"
                ) from None
            # Hand DCP a re-serialized copy of the vetted value: its own loader stays unchanged.
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            super().load_bytes(read_item, buf)

    return SafeFileSystemReader(str(ckpt)), SafeLoadPlanner()
