"""The Ollama Modelfile's chat template: each family's Jinja chat template as published (in a tiny
tokenizer) is recognised, and the family's Go template -- run by a small emulation of the part of
Go's text/template it uses -- renders a system + user + assistant + user conversation as the
Jinja template does; the Modelfile carries that template and the family's stop tokens."""

from __future__ import annotations

import re

import pytest
import tokenizers

from featherweight.io.ollama import FAMILIES, chat_family, modelfile_text
from featherweight.io.tokenizer import Tokenizer

# --- the published chat templates (tokenizer_config.json's `chat_template`) --------------------

GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI3_5 = PHI3.replace(
    "message['role'] == 'system' %}", "message['role'] == 'system' and message['content'] %}"
)
PHI4 = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + message['content'] + "
    "'<|im_end|><|im_start|>assistant<|im_sep|>'}}{% elif (message['role'] == 'assistant') %}"
    "{{message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
)
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# case -> (template, BOS, the family, the specials of its vocabulary, whether it takes a system)
CASES = {
    "gemma2": (GEMMA2, "<bos>", "gemma", ["<start_of_turn>", "<end_of_turn>"], False),
    "gemma3": (GEMMA3, "<bos>", "gemma", ["<start_of_turn>", "<end_of_turn>"], True),
    "phi3": (PHI3, None, "phi3", ["<|user|>", "<|assistant|>", "<|end|>", "<|system|>"], True),
    "phi3.5": (PHI3_5, None, "phi3", ["<|user|>", "<|assistant|>", "<|end|>"], True),
    "phi4": (PHI4, None, "phi4", ["<|im_start|>", "<|im_sep|>", "<|im_end|>"], True),
    "phi4-mini": (PHI4_MINI, None, "phi4-mini", ["<|user|>", "<|assistant|>", "<|end|>"], True),
    "qwen3": (QWEN3, None, "chatml", ["<|im_start|>", "<|im_end|>"], True),
}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
]


def tiny_tokenizer(template: str, bos: str | None, specials: list[str]) -> Tokenizer:
    """A word-level tokenizer of just the format's special tokens, EOS and BOS."""
    tokens = ["<unk>", "<eos>", *([bos] if bos else []), *specials]
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({token: i for i, token in enumerate(tokens)}, "<unk>")
    )
    return Tokenizer(backend, template, bos_token=bos, eos_token="<eos>")


# --- the part of Go's text/template the families' templates use ----------------------------------

_ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.DOTALL)


def _parse(template: str) -> list:
    """[text | (kind, argument, body, else_body)] from the template: range, if / else if / else,
    `$v := x`, `$v = x` and printed values; `{{-` and `-}}` trim the text beside them."""
    parts, position = [], 0
    for match in _ACTION.finditer(template):
        text = template[position : match.start()]
        parts.append(text.rstrip() if match.group(1) else text)
        parts.append(("action", match.group(2), bool(match.group(3))))
        position = match.end()
    parts.append(template[position:])
    for index, part in enumerate(parts):
        if isinstance(part, tuple) and part[2] and isinstance(parts[index + 1], str):
            parts[index + 1] = parts[index + 1].lstrip()
    tokens = iter(part for part in parts if part != "")

    def block() -> tuple[list, str]:
        """The nodes up to the closing `end` or `else ...` action, and that action."""
        nodes = []
        for token in tokens:
            if isinstance(token, str):
                nodes.append(token)
            elif token[1] == "end" or token[1].startswith("else"):
                return nodes, token[1]
            elif token[1].startswith(("range ", "if ")):
                nodes.append(branch(*token[1].split(" ", 1)))
            else:
                nodes.append(("value", token[1], [], []))
        return nodes, "end"

    def branch(kind: str, argument: str) -> tuple:
        body, closing = block()
        if closing == "else":
            return kind, argument, body, block()[0]
        if closing.startswith("else if "):  # one `end` closes the whole chain
            return kind, argument, body, [branch("if", closing.removeprefix("else if "))]
        return kind, argument, body, []

    return block()[0]


def _value(expression: str, dot: dict, root: dict, variables: dict):
    words = re.findall(r'"[^"]*"|\S+', expression)
    if words[0] in ("eq", "ne", "and", "not"):
        values = [_value(word, dot, root, variables) for word in words[1:]]
        return {
            "eq": lambda: values[0] == values[1],
            "ne": lambda: values[0] != values[1],
            "and": lambda: all(values),
            "not": lambda: not values[0],
        }[words[0]]()
    (word,) = words
    if word.startswith('"'):
        return word[1:-1]
    if word.startswith("$."):
        return root[word[2:]]
    if word.startswith("."):
        return dot[word[1:]]
    return variables[word]


def go_render(template: str, messages: list[dict[str, str]]) -> str:
    """Ollama's rendering of `messages` by `template` (its template.Execute: `.Messages`, system
    messages included, with `.Role` and `.Content`; `.System` the system messages' text)."""
    collated: list[dict[str, str]] = []  # Ollama joins a role's consecutive messages
    for m in messages:
        if collated and collated[-1]["Role"] == m["role"]:
            collated[-1]["Content"] += "\n\n" + m["content"]
        else:
            collated.append({"Role": m["role"], "Content": m["content"]})
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    root = {"Messages": collated, "System": system}
    variables: dict = {}

    def run(nodes, dot) -> str:
        out = ""
        for node in nodes:
            if isinstance(node, str):
                out += node
                continue
            kind, argument, body, otherwise = node
            if kind == "range":
                out += "".join(run(body, item) for item in _value(argument, dot, root, variables))
            elif kind == "if":
                out += run(body if _value(argument, dot, root, variables) else otherwise, dot)
            elif (assignment := re.fullmatch(r"(\$\w+) :?= (.*)", argument)) is not None:
                variables[assignment.group(1)] = _value(assignment.group(2), dot, root, variables)
            else:
                out += str(_value(argument, dot, root, variables))
        return out

    return run(_parse(template), root)


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_published_template_is_recognised_and_the_go_template_renders_as_it_does(case):
    template, bos, name, specials, takes_system = CASES[case]
    tokenizer = tiny_tokenizer(template, bos, specials)
    family, default_system = chat_family(tokenizer)
    assert family is not None and family.name == name and default_system is None, case
    conversation = CONVERSATION if takes_system else CONVERSATION[1:]
    expected = tokenizer.apply_chat_template(conversation).removeprefix(bos or "")
    assert go_render(family.go_template, conversation) == expected
    assert family.render(conversation) == expected


def test_gemma2_folds_a_system_prompt_as_gemma3_does():
    """Gemma 2's template refuses a system message; Ollama's SYSTEM reaches the model as Gemma 3's
    template places it, at the start of the first user turn."""
    gemma = {family.name: family for family in FAMILIES}["gemma"]
    expected = tiny_tokenizer(GEMMA3, "<bos>", []).apply_chat_template(CONVERSATION)
    assert go_render(gemma.go_template, CONVERSATION) == expected.removeprefix("<bos>")
    assert "<start_of_turn>user\nYou are terse.\n\nWhat colour" in expected


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_go_template_renders_as_its_family(family):
    """The emulation agrees with each family's Python rendering (ChatML, Llama 3 and [INST] too);
    [INST]'s Go template leaves the system prompt out."""
    conversation = CONVERSATION if family.places_system else CONVERSATION[1:]
    assert go_render(family.go_template, CONVERSATION) == family.render(conversation)


@pytest.mark.parametrize(
    ("case", "stops"),
    [
        ("gemma3", ["<end_of_turn>", "<start_of_turn>", "<eos>"]),
        ("phi3", ["<|end|>", "<|user|>", "<|assistant|>", "<eos>"]),
        ("phi4", ["<|im_end|>", "<|im_start|>", "<eos>"]),
        ("qwen3", ["<|im_end|>", "<|im_start|>", "<eos>"]),
    ],
)
def test_modelfile_carries_the_go_template_and_stop_tokens(case, stops):
    template, bos, _, specials, _ = CASES[case]
    tokenizer = tiny_tokenizer(template, bos, specials)
    text = modelfile_text(tokenizer, "./model.gguf")
    family, _ = chat_family(tokenizer)
    assert f'TEMPLATE """{family.go_template}"""' in text
    assert re.findall(r'PARAMETER stop "(.*)"', text) == stops


def test_a_template_that_places_the_system_prompt_elsewhere_is_not_recognised():
    """Phi-3's turns, but a system prompt written as a user turn: no family renders it so; the
    Modelfile leaves the template to Ollama."""
    template = PHI3.replace(
        "'<|system|>\n' + message['content']", "'<|user|>\n' + message['content']"
    )
    tokenizer = tiny_tokenizer(template, None, ["<|user|>", "<|assistant|>", "<|end|>"])
    assert chat_family(tokenizer) == (None, None)
    assert "TEMPLATE" not in modelfile_text(tokenizer, "./model.gguf")
