"""Qwen3's added tokens: the ids, text and special flag its tokenizer gives them (tokenizer.json's added_tokens
in Qwen/Qwen3-8B and the other Qwen3 checkpoints; the same table as Qwen2.5 plus <tool_response> and <think>).

The built-in tokenizer (data/qwen_bpe.QwenBPETokenizer) carries exactly these after the 151,643 BPE ranks, so a
preset's ids are a Qwen3 checkpoint's: `<think>` is 151667, and the vocabulary is 151,669 ids long.
"""

from __future__ import annotations

# (id, text, special): special tokens are never matched inside text; the others (tool calls, think blocks,
# fill-in-the-middle markers) are, as Qwen3's tokenizer matches them
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
# added tokens that Qwen's own tokenizers keep as text-matched, not special (tool, reasoning and code-infill marks)
NOT_SPECIAL = frozenset(text for _, text, special in QWEN3_ADDED_TOKENS if not special)
