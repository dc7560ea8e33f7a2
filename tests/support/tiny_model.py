"""The tiny model of the tests, in one place (``from tiny_model import TINY``): a Qwen2 built in code
(``load_model_and_tokenizer("tiny-qwen2", model_config=TINY)``: 2 decoder layers, hidden 32, a 300-token character
vocabulary) small enough that a training step takes well under a second on one CPU thread."""

from __future__ import annotations

import json

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
#: ``--model-config`` of a benchmark run of seconds: the same model with one decoder layer, as JSON.
TINY_ONE_LAYER = json.dumps({**TINY, "num_hidden_layers": 1})
