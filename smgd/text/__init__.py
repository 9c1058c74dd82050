"""The text pipeline: tokenizer + chat template in, incremental text + stop strings out.

Pure and synchronous (no trio). ``load_tokenizer`` once per engine model dir; one
``TextStream`` per request choice.
"""

from smgd.text.chat import ChatTemplate
from smgd.text.detok import IncrementalDetokenizer
from smgd.text.stops import StopMatcher
from smgd.text.stream import TextStream
from smgd.text.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ChatTemplate",
    "IncrementalDetokenizer",
    "StopMatcher",
    "TextStream",
    "Tokenizer",
    "load_tokenizer",
]
