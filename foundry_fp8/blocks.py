"""How te_swap numbers transformer blocks from module names (its keep_first/last_blocks count
them): one home, read by te_swap's filters and by the health advice that names those options.
Imports nothing of ours, so both can."""

from __future__ import annotations

import re

#: A module inside a transformer block: `...blocks.<index>.` (LLM-Foundry's MPTModel.blocks),
#: `...layers.<index>.` (Hugging Face's Llama, Mistral, Qwen2, Gemma, GPT-NeoX, OPT decoders, as
#: LLM-Foundry's `hf_causal_lm` builds them), `...h.<index>.` (Falcon, BLOOM; GPT-2's are
#: Conv1D, not Linear) or `...block.<index>.` (T5's `encoder.block`/`decoder.block`, as
#: LLM-Foundry's `hf_t5` builds them; mT5, UMT5, LongT5). A model with several stacks (T5's
#: encoder and decoder, a vision tower's `encoder.layers`) has them all matched, and their
#: indices share keep_first/last_blocks: use include/exclude.
BLOCK_CONTAINERS = ("blocks", "layers", "h", "block")
_BLOCK = re.compile(rf"\b(?:{'|'.join(BLOCK_CONTAINERS)})\.(\d+)\.")


def block_index(name: str) -> int | None:
    """The index of the transformer block module `name` lies in; None outside the blocks."""
    match = _BLOCK.search(name + ".")
    return int(match.group(1)) if match is not None else None
