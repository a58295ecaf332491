"""Qwen3's chat template: recognising the one Qwen3 checkpoints ship, and our own Jinja rendering of the format.

A checkpoint whose tokenizer carries Qwen3's shipped template (recognised by its SHA-256, as TRL recognises
it by its text) is rendered by the built-in Qwen3 format (data/chat.py), which writes the same bytes; with
assistant_only_loss that is the training variant, every assistant turn with its think block.

QWEN3_CHAT_TEMPLATE is this project's own Jinja template for the built-in format as Qwen3 renders it for
inference. An export whose tokenizer has no template gets it, so `apply_chat_template` on `final/` writes
what the model was trained on. tests/test_qwen3_format.py renders it, the built-in format and Qwen3's
template on random conversations and compares them.
"""

from __future__ import annotations

import hashlib

# sha256 of the chat_template that Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B ship in tokenizer_config.json
QWEN3_SHIPPED_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"
TURN_END = "<|im_end|>"  # Qwen3's end of a turn, the eos its checkpoints generate with


def is_qwen3_template(template: object) -> bool:
    """Whether `template` is the chat template Qwen3 checkpoints ship (a dict of named templates: its default)."""
    if isinstance(template, dict):
        template = template.get("default")
    return isinstance(template, str) and hashlib.sha256(template.encode("utf-8")).hexdigest() == QWEN3_SHIPPED_SHA256


# Our rendering, written for this project: content is a string (the trainer joins text parts before
# rendering); think blocks only after the last user query, as Qwen3 prompts at inference.
QWEN3_CHAT_TEMPLATE = r"""{%- set n = messages | length -%}
{%- set has_system = n > 0 and messages[0].role == 'system' -%}
{%- macro text(m) -%}{{ m.content if m.content is string else '' }}{%- endmacro -%}
{%- if tools or has_system -%}
<|im_start|>system
{% if has_system %}{{ messages[0].content }}{% endif -%}
{%- if tools -%}
{% if has_system %}{{ '\n\n' }}{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for t in tools -%}{{ '\n' }}{{ t | tojson }}{%- endfor -%}
{{ '\n' }}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{%- endif -%}
<|im_end|>{{ '\n' }}
{%- endif -%}
{%- set state = namespace(query=n - 1, found=false) -%}
{%- for i in range(n - 1, -1, -1) -%}
{%- set c = text(messages[i]) -%}
{%- if not state.found and messages[i].role == 'user' and messages[i].content is string
      and not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) -%}
{%- set state.query = i -%}{%- set state.found = true -%}
{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- set i = loop.index0 -%}
{%- set body = text(m) -%}
{%- if m.role == 'system' and i == 0 -%}
{%- elif m.role == 'user' or m.role == 'system' -%}
<|im_start|>{{ m.role }}{{ '\n' }}{{ body }}<|im_end|>{{ '\n' }}
{%- elif m.role == 'assistant' -%}
{%- set thought = '' -%}
{%- if m.reasoning_content is string -%}
{%- set thought = m.reasoning_content -%}
{%- elif '</think>' in body -%}
{%- set thought = body.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
{%- set body = body.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
<|im_start|>assistant{{ '\n' }}
{%- if i > state.query and (loop.last or thought) -%}
<think>{{ '\n' }}{{ thought.strip('\n') }}{{ '\n' }}</think>{{ '\n\n' }}{{ body.lstrip('\n') }}
{%- else -%}
{{ body }}
{%- endif -%}
{%- for call in (m.tool_calls or []) -%}
{%- set f = call.function if call.function else call -%}
{%- if body or not loop.first %}{{ '\n' }}{% endif -%}
<tool_call>{{ '\n' }}{"name": "{{ f.name }}", "arguments":{{- ' ' -}}
{{- f.arguments if f.arguments is string else f.arguments | tojson -}}
{{- '}\n' }}</tool_call>
{%- endfor -%}
<|im_end|>{{ '\n' }}
{%- elif m.role == 'tool' -%}
{%- if i == 0 or messages[i - 1].role != 'tool' %}<|im_start|>user{% endif -%}
{{ '\n' }}<tool_response>{{ '\n' }}{{ body }}{{ '\n' }}</tool_response>
{%- if loop.last or messages[i + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant{{ '\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}<think>{{ '\n\n' }}</think>{{ '\n\n' }}{% endif -%}
{%- endif -%}
"""
