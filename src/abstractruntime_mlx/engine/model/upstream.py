"""Where the model folder reads mlx-lm's private names, and only here
(``tests/test_import_graph.py``); mlx-lm is pinned ``>=0.31.3,<0.33`` in pyproject.toml and
``tests/test_backend_contract.py`` checks what is read: ``PromptProcessingBatch._copy`` (the
prefill warm-up's bucketed batch) and ``TokenizerWrapper``'s ``_tokenizer`` / ``_detokenizer``
(the serialized lane's tokenizer).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx


def tokenizer_parts(wrapper: Any) -> tuple[Any, Any]:
    """The Hugging Face tokenizer and the streaming detokenizer inside mlx-lm's ``TokenizerWrapper``."""
    return wrapper._tokenizer, wrapper._detokenizer


@functools.cache
def bucketed_prompt_batch() -> Any:
    """mlx-lm's ``PromptProcessingBatch`` with each chunk right-padded to its length bucket
    (``prefill_shapes.Buckets``, set as ``buckets`` on each batch)."""
    from mlx_lm.generate import PromptProcessingBatch

    class BucketedPromptBatch(PromptProcessingBatch):
        """mlx-lm's prompt batch, each chunk right-padded to its length bucket."""

        buckets: Any  # a prefill_shapes.Buckets

        def _copy(self) -> Any:
            new = PromptProcessingBatch._copy(self)
            new.buckets = self.buckets
            return new

        def prompt(self, tokens: list[list[int]]) -> None:
            longest = max((len(t) for t in tokens), default=0)
            width = self.buckets.length(longest)
            if not tokens or len(tokens) != len(self.uids) or width == longest:
                super().prompt(tokens)  # already a bucket's shape (or upstream's error)
                return
            for have, new in zip(self.tokens, tokens):
                have += new  # the tokens the KV cache holds, as upstream keeps them
            lengths = [len(t) for t in tokens]
            padding = [width - n for n in lengths]
            inputs = mx.array([t + [0] * p for t, p in zip(tokens, padding)])
            for c in self.prompt_cache:
                c.prepare(lengths=lengths, right_padding=padding)
            self.model(inputs, cache=self.prompt_cache)
            for c in self.prompt_cache:
                c.finalize()
            mx.eval([c.state for c in self.prompt_cache])
            mx.clear_cache()

    return BucketedPromptBatch
