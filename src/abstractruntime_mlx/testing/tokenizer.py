"""A small byte-level BPE tokenizer trained offline on a corpus generated in code.

The corpus comes from a fixed word list and a fixed-seed ``random.Random``, so the trained
tokenizer is the same on every machine and does not depend on files from the OS.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

from .chat_template import CHAT_TEMPLATE

VOCAB_SIZE = 2000
CORPUS_SEED = 1234
NUM_CORPUS_LINES = 4000

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Special tokens get the lowest ids, in this order (<|endoftext|> = 0, <|im_end|> = 2, ...).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# Markup tokens that stay visible when decoding with skip_special_tokens (as in Qwen).
MARKUP_TOKENS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"})

_WORDS = """
the a an of to in on at for with from by and or but not is are was were be been has have had
do does did will would can could should may might must this that these those it its he she they
we you i me my your our their his her them us what which who when where why how all any some
each every no yes one two three four five six seven eight nine ten hundred thousand first last
next new old good bad big small long short high low right left red green blue yellow black white
orange purple gray image picture photo color colour shape square circle line point word sentence
text token model runtime node flow graph request response answer question user assistant system
tool call result function name value key data list item number string error message time day
week year hello world please thanks weather city temperature search file path read write open
close start stop run runs running ran make made take took give gave find found think thought
know knew see saw look looked say said tell told ask asked use used work worked try tried help
describe explain summary summarize translate compute count add sum total price cost order
""".split()

_SYLLABLES = "ka lo mi nu pe ra si to vu xe ba de fi go hu ja ke li mo ne po qu re sa ti".split()


def _corpus(num_lines: int = NUM_CORPUS_LINES, seed: int = CORPUS_SEED) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        kind = rng.randrange(6)
        if kind <= 1:  # plain prose
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
            words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
        elif kind == 2:  # made-up words, so BPE has something to merge beyond English
            words = [_made_up_word(rng) for _ in range(8)]
            lines.append(" ".join(words))
        elif kind == 3:  # numbers and arithmetic
            a, b = rng.randint(0, 9999), rng.randint(0, 999)
            lines.append(f"{a} + {b} = {a + b}; {a}.{b} {rng.random():.4f}")
        elif kind == 4:  # JSON, as in tool calls and results
            name = rng.choice(["get_weather", "search", "add", "read_file", "lookup"])
            key = rng.choice(_WORDS)
            value = rng.choice([rng.choice(_WORDS), rng.randint(0, 100)])
            lines.append(json.dumps({"name": name, "arguments": {key: value}}))
        else:  # code-ish and chat-ish lines
            name = rng.choice(_WORDS)
            templates = [f"def {name}(x, y):\n    return x + y", f"user: {name}?", f"assistant: {name}."]
            lines.append(rng.choice(templates))
    return lines


def _made_up_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))


@functools.cache
def build_tokenizer() -> Any:
    """Train the byte-level BPE and wrap it as a ``PreTrainedTokenizerFast`` (deterministic).

    Cached: training takes about half a second and the result never changes. Treat the
    returned tokenizer as read-only.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)

    # Markup tokens keep their low ids but are not "special": they survive
    # decode(skip_special_tokens=True), as in Qwen tokenizers.
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] not in MARKUP_TOKENS
    tok = Tokenizer.from_str(json.dumps(spec))

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer: Any, path: Path) -> None:
    """Write tokenizer files, pinning ``tokenizer_class`` to ``PreTrainedTokenizerFast``."""
    tokenizer.save_pretrained(str(path))
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def token_ids(tokenizer: Any) -> dict[str, int]:
    """Ids of the special and markup tokens, by token text."""
    return {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
