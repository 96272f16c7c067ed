"""The workbench's error classes and install hints: a leaf module (config_checks, which it imports, is one too), so any
package can raise them without cycles."""

from __future__ import annotations

from workbench.config_checks import ConfigError

# What to install for each optional backend: the message names the extra and the package.
INSTALL_HINT: dict[str, str] = {
    "te": "pip install 'moe-workbench[te]'  (transformer-engine[pytorch]; needs a CUDA GPU)",
    "deepep": (
        "pip install 'moe-workbench[deepep]'  (deep-ep; the PyPI build needs DeepSeek's patched NVSHMEM: "
        "for intranode EP build DeepEP 1.2.x from source without NVSHMEM; see workbench/moe/dispatch/deepep.py)"
    ),
    "triton": "pip install triton  (ships with CUDA builds of torch; needs a CUDA GPU)",
    "liger": "pip install 'moe-workbench[gpu]'  (liger-kernel; needs a CUDA GPU)",
}


class BackendError(ValueError):
    """A backend name that is unknown, uninstalled or unsupported on the device."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or resumed: missing, damaged, crafted, or of another shape."""


class DataError(ConfigError):
    """Data a run cannot train on (a file, a row, the tokenizer, the tokenized cache), naming what to fix.

    A ConfigError: it is found before training starts, so the CLI reports it as one line with exit code 2.
    """
