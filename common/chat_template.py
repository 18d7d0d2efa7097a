r"""The chat template of the tiny checkpoints: Qwen's ChatML layout with Hermes-style tool calls.

Saved as `chat_template.jinja` in a checkpoint, the file transformers reads for both the tokenizer
and the processor. What it renders (Qwen3-VL's format, written for this project):

    <|im_start|>system\n{system}\n\n# Tools\n\n...<tools>\n{tool json}\n</tools>...<|im_end|>\n
    <|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n
    <|im_start|>assistant\n{content}\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{feedback}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\n                                   (add_generation_prompt)

Rules: no default system turn (a message rendered alone gets no preamble); content is a string or
a list of parts (`{"type": "image"}` / `"image"` / `"image_url"` keys -> the vision placeholder,
`video` likewise with `<|video_pad|>`, `text` -> the text); a run of consecutive `tool` messages
shares one user turn; assistant content is written verbatim (no stripping of `<think>` or
whitespace), so a conversation renders as its turns' renders concatenated, and an assistant turn
is exactly the generation prompt + content + `<|im_end|>\n`. Tool-call arguments given as a string
are written as is, objects as JSON.
"""

from __future__ import annotations

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _jinja_str(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# Every literal goes through {{- '...' }} and every tag trims whitespace, so the output does not
# depend on the environment's trim_blocks / lstrip_blocks settings.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is not none -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'image' or part.type == 'image_url' or 'image' in part or 'image_url' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' or 'video' in part -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}
        {{- render_content(messages[0].content) + '\\n\\n' -}}
    {%- endif -%}
    {{- TOOLS_PREAMBLE -}}
    {%- for tool in tools -%}
        {{- '\\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- TOOLS_POSTAMBLE + '<|im_end|>\\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) -%}
        {{- '<|im_start|>assistant\\n' + content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- if call.function is defined -%}
                {%- set call = call.function -%}
            {%- endif -%}
            {%- if content or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {{- '<tool_call>\\n{"name": ' + (call.name | tojson) + ', "arguments": ' -}}
            {%- if call.arguments is string -%}
                {{- call.arguments -}}
            {%- else -%}
                {{- call.arguments | tojson -}}
            {%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
""".replace("TOOLS_PREAMBLE", _jinja_str(TOOLS_PREAMBLE)).replace(
    "TOOLS_POSTAMBLE", _jinja_str(TOOLS_POSTAMBLE))
