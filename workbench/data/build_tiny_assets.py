"""Regenerate the shipped tiny SFT dataset and its tokenizer (deterministic, no downloads).

    python -m workbench.data.build_tiny_assets

The rows are small templated tasks (arithmetic, word reversal, counting, colours of things) so
a tiny model's loss visibly drops within a few dozen steps. The tokenizer is a byte-level BPE
trained on exactly these rows with the `tokenizers` library, saved as a PreTrainedTokenizerFast
directory with a ChatML-style chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|unk|>", "<|im_end|>", "<|im_start|>"]  # ids 0..3; eos = <|im_end|>

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = [
    "cat",
    "dog",
    "sun",
    "tree",
    "moon",
    "fish",
    "bird",
    "rain",
    "star",
    "milk",
    "book",
    "lamp",
    "rose",
    "frog",
    "bell",
    "cake",
    "ship",
    "wolf",
    "leaf",
    "snow",
]
COLOURS = {
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "blood": "red",
    "banana": "yellow",
    "orange": "orange",
    "plum": "purple",
    "sand": "beige",
    "ash": "grey",
}
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def make_rows(seed: int = 1234) -> list[dict]:
    """A few hundred short prompt/response rows and some multi-turn chat rows."""
    rng = random.Random(seed)
    rows: list[dict] = []
    for _ in range(120):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."})
    for _ in range(60):
        w = rng.choice(WORDS)
        rows.append({"prompt": f"Reverse the word {w}.", "response": f"The word {w} reversed is {w[::-1]}."})
    for _ in range(60):
        n = rng.randint(1, 10)
        w = rng.choice(WORDS)
        rows.append({"prompt": f"Write {NUMBER_WORDS[n]} times: {w}", "response": " ".join([w] * n)})
    for thing, colour in COLOURS.items():
        for _ in range(4):
            rows.append({"prompt": f"What colour is {thing}?", "response": f"{thing.capitalize()} is {colour}."})
    for _ in range(40):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        w = rng.choice(WORDS)
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "You are a brief assistant."},
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a + b}."},
                    {"role": "user", "content": f"And the first letter of {w}?"},
                    {"role": "assistant", "content": f"It is {w[0]}."},
                ]
            }
        )
    rng.shuffle(rows)
    return rows


def build_tokenizer(rows: list[dict], out_dir: Path) -> None:
    """Train a byte-level BPE on the rows and save it as a PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for row in rows:
        if "messages" in row:
            texts.extend(m["role"] + "\n" + m["content"] for m in row["messages"])
        else:
            texts.extend(["user\n" + row["prompt"], "assistant\n" + row["response"]])
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def main() -> None:
    rows = make_rows()
    with open(HERE / "tiny_sft.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    build_tokenizer(rows, HERE / "tokenizer")
    print(f"wrote {len(rows)} rows and a {VOCAB_SIZE}-token tokenizer under {HERE}")


if __name__ == "__main__":
    main()
