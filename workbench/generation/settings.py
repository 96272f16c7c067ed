"""How a reply is sampled: its length, temperature, nucleus (top-p), seed, and whether the chat template wraps the
prompt."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config_checks import ConfigError, check_float, check_int

MAX_NEW_TOKENS = 128
TEMPERATURE = 0.7
TOP_P = 0.9
# Far above any reply worth reading in a terminal or a notebook; a typo (1e9) would otherwise allocate a
# key-value cache for it before the first token
MAX_NEW_TOKENS_LIMIT = 32768


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling settings of one reply; temperature 0 is greedy decoding (top_p and seed then change nothing)."""

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    seed: int | None = None  # None: a different sample each time
    chat_template: bool = True  # wrap the prompt in the tokenizer's chat template, where it has one

    def __post_init__(self) -> None:
        check_int(self.max_new_tokens, "max_new_tokens", 1)
        if self.max_new_tokens > MAX_NEW_TOKENS_LIMIT:
            raise ConfigError(f"max_new_tokens must be at most {MAX_NEW_TOKENS_LIMIT}, got {self.max_new_tokens}")
        check_float(self.temperature, "temperature", 0.0)
        check_float(self.top_p, "top_p", 0.0, 1.0)
        if self.top_p == 0:
            raise ConfigError("top_p must be > 0 (1 keeps every token; 0 would keep none)")
        check_int(self.seed, "seed", 0, allow_none=True)
        if not isinstance(self.chat_template, bool):
            raise ConfigError(f"chat_template must be True or False, got {self.chat_template!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generate_kwargs(self) -> dict:
        """These settings as Transformers' generate() arguments (top_k off: only what the user set filters)."""
        if self.greedy:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": True,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": 0,
        }


def check_prompt(prompt: object) -> str:
    """The prompt, refused unless it is a non-empty string."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"the prompt must be a non-empty string, got {prompt!r:.60}")
    return prompt
