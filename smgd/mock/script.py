"""Scripted replies for the mock engine: canned model outputs for chosen prompts.

The mock echoes the prompt; a tool call, a reasoning block or any other model output cannot
be echoed. A script (``[engines.mock] script``, a TOML file of ``[[reply]]`` tables, read by
:func:`smgd.config.load_mock_script`) gives the text to write instead: the first reply whose
``when`` occurs in the prompt's text (``""``: every prompt) is written token by token, with
the model's own tokenizer, then EOS, exactly as a model would. A prompt no reply is for is
echoed as before, so the plain echo stays what it was and everything stays deterministic.

Sans-IO: the tokenizer comes in as ``encode``/``decode`` callables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from smgd.config import MockScript


class Script:
    """Replies in file order, each as ``(when, token ids)``."""

    def __init__(
        self, replies: Sequence[tuple[str, list[int]]], decode: Callable[[list[int]], str]
    ) -> None:
        self.replies = list(replies)
        self._decode = decode

    @classmethod
    def build(
        cls,
        script: MockScript,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
    ) -> Script:
        return cls([(reply.when, encode(reply.text)) for reply in script.reply], decode)

    def pick(self, prompt_ids: list[int]) -> list[int] | None:
        """The token ids of the reply for this prompt, or None (echo it)."""
        if not self.replies:
            return None
        # Decoded once per request, only when a script is loaded: the mock is a test tool.
        text = self._decode(prompt_ids)
        for when, ids in self.replies:
            if when in text:
                return ids
        return None
