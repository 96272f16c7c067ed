"""Reading the files a RunConfig comes from: YAML as people write it, a checkpoint's config.json.

Both turn a malformed file into a ConfigError that names the file, before any heavy work.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from workbench.config_checks import ConfigError
from workbench.errors import CheckpointError
from workbench.models.hf_io import check_model_folder

# YAML 1.1 (PyYAML) reads a float only with a dot and a signed exponent: 1e-3, 3e-4 and 1E5 come
# back as strings. PyYAML's own float pattern with the exponent's sign and the dot made optional
# (as YAML 1.2 has it); .inf/.nan stay floats, so the dataclass checks see and refuse them.
_YAML_FLOAT_TAG = "tag:yaml.org,2002:float"
_YAML_FLOAT = re.compile(
    r"""^(?:
     [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _numbers_as_written(base: type) -> type:
    """A subclass of yaml's SafeLoader or SafeDumper that resolves floats with _YAML_FLOAT.

    The dumper needs it too: it quotes a string only when the resolvers would read it as
    something else, and a run_id '1e-3' written bare would come back as a float.
    """

    class NumbersAsWritten(base):
        pass

    # Same resolvers in the same order, only the float pattern replaced (base is not touched).
    NumbersAsWritten.yaml_implicit_resolvers = {
        first: [(tag, _YAML_FLOAT if tag == _YAML_FLOAT_TAG else rx) for tag, rx in resolvers]
        for first, resolvers in base.yaml_implicit_resolvers.items()
    }
    return NumbersAsWritten


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that 1e-3, 3e-4 and 1E5 are floats (YAML 1.1 reads them as strings)."""
    return yaml.load(text, Loader=_numbers_as_written(yaml.SafeLoader))


def dump_yaml(data: Any) -> str:
    """`yaml.safe_dump` (keys in order) whose output `load_yaml` reads back unchanged."""
    return yaml.dump(data, Dumper=_numbers_as_written(yaml.SafeDumper), sort_keys=False)


def read_hf_config(path: Path):
    """The transformers config in `path`/config.json; a ConfigError naming the file if it cannot be one."""
    import difflib

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"model.path {str(path)!r} is not a local checkpoint directory (no config.json)")
    try:
        check_model_folder(path)  # a file named outside the folder is refused here, before any rank starts
    except CheckpointError as err:
        raise ConfigError(f"model.path {str(path)!r}: {err}") from None
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(
            f"{file} is not valid JSON ({err}); point model.path to a checkpoint directory written by save_pretrained"
        ) from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        from workbench.models.generic import TESTED_FAMILIES  # torch and Transformers' models: only for this message

        if model_type is None:
            what = "has no model_type"
        else:
            what = f"has model_type {model_type!r}, which Transformers {transformers.__version__} does not know"
            close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING), n=3, cutoff=0.8)
            if close:
                what += f" (did you mean {' or '.join(map(repr, close))}?)"
        raise ConfigError(
            f"{file} {what}. Model families the engine supports: every Transformers v5 family with "
            f"fused experts (tested: {', '.join(TESTED_FAMILIES)}); fix "
            "model_type there or point model.path to a checkpoint written by save_pretrained"
        )
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"{file} is not a valid {model_type} config: {type(err).__name__}: {err}") from err
