"""The syntax check behind skeletons: which templates print a message's text verbatim.

Each template is checked as parsed; what the check accepts, the hypothesis tests of
``test_render_skeleton.py`` then fill and compare with whole renders.
"""

from __future__ import annotations

import pytest

from kvroute.tokenizer_index.chat_template import ChatTemplate
from kvroute.tokenizer_index.render_skeleton import SkeletonRenders
from kvroute.tokenizer_index.template_verbatim import Verbatim, verbatim_check
from tests.tokenizer_index.test_render_memo import ALL_TEMPLATES

#: Templates the syntax check lets fill skeletons (the rest must be refused).
FILLED = {
    *("prefix_stable", "counted", "marks_last", "raw", "thinking_prompt", "default", "qwen25", "qwen3"),
    *("llama3", "llama3_index", "llama31", "mistral", "mistral_first", "mixtral_last", "qwen3_coder"),
    *("gemma3", "openai_parts", "deepseek", "qwen35", "glm45", "glm47"),
}

# Templates that print texts only as they are, trimmed, or chosen by their truth.
VERBATIM = {
    "trimmed": (
        "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    ),
    "set_and_joined": (
        "{% set first = messages[0]['content'] if messages[0]['content'] is string else '' %}"
        "{{ first ~ '|' }}{% for m in messages %}{% set text = m['content'] or '(nothing)' %}"
        "{% if text and not loop.first %}<{{ m['role'] }}>{{ text + '</' + m['role'] + '>' }}{% endif %}"
        "{% endfor %}"
    ),
    "generation_tag": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.role + ': ' + m.content }}{% endif %}\n{% endfor %}"
    ),
    # Texts tested for what they hold: a skeleton is for texts that answer no (others render whole).
    "tested": (
        "{% for m in messages %}{% if '<think>' in m.content or m.content.startswith('#') %}{{ m.content | length }}"
        "{% else %}{{ m.role }}: {{ m.content.lstrip('\\n') }}\n{% endif %}{% endfor %}"
    ),
    # Today's date, whose text joins the shape's key.
    "clock": "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m.content }}{% endfor %}",
    # A branch no plain message takes reads its text otherwise (Llama 3.1's tool results).
    "tool_branch": (
        "{% if messages[0].role == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set loop_messages = messages %}{% endif %}"
        "{% for m in loop_messages %}{% if not (m.role == 'tool' or 'tool_calls' in m) %}{{ m.role }}: "
        "{{ (m.content or '') | trim }}\n{% elif m.role == 'ipython' %}{{ m.content | tojson }}"
        "{% else %}{{ m.content | length }}{% endif %}{% endfor %}"
    ),
    # Texts measured only for being empty (Qwen 3 Coder: ``content | trim | length > 0``).
    "measured_empty": (
        "{% for m in messages %}{% if m.content | trim | length > 0 %}<{{ m.content | trim }}>"
        "{% elif 0 == m.content | length %}(empty){% endif %}{% if not m.content | length %}!{% endif %}{% endfor %}"
    ),
    # Consecutive messages of a role grouped by their neighbours' roles.
    "neighbours": (
        "{% for m in messages %}{% if loop.previtem and loop.previtem.role != m.role %}<{{ m.role }}>{% endif %}"
        "{{ m.content }}{% if loop.previtem is defined and loop.previtem.content %}+{% endif %}"
        "{% if not loop.last and loop.nextitem.role != m.role %}</{{ m.role }}>{% elif loop.last %}.{% endif %}"
        "{% endfor %}"
    ),
    # Every text through a macro that prints a string as it is (Qwen 3.5's render_content).
    "macro": (
        "{% macro show(t, counted=false) %}{% if t is string %}{{ t }}{% elif t is iterable %}"
        "{% for p in t %}{{ p.text | length }}{% endfor %}{% else %}{{ raise_exception('no') }}{% endif %}"
        "{% endmacro %}{% for m in messages %}{% set text = show(m.content, true) | trim %}"
        "{% if not text.startswith('#') %}{{ m.role }}: {{ text }}\n{% endif %}{% endfor %}"
    ),
    # Texts gathered in a namespace and printed (DeepSeek V3's system prompt).
    "namespace": (
        "{% set ns = namespace(last='', system='', first=true) %}{% for m in messages %}{% set ns.last = m.content %}"
        "{% if m.role == 'system' %}{% set ns.system = ns.system + ('' if ns.first else '\\n') + m.content %}"
        "{% set ns.first = false %}{% endif %}{% endfor %}[{{ ns.system }}]{% if ns.last %}{{ ns.last | tojson }}{% endif %}"
    ),
    "roles_checked": (
        "{% for m in messages %}{% if m.role == 'developer' %}{{ raise_exception('no developer here') }}{% endif %}"
        "{{ m.role }}={{ m.content }};{% endfor %}"
    ),
}

# Templates that read texts some other way: refused, whatever a probe would show.
REFUSED = {
    "length": "{% for m in messages %}{{ m.content | length }}{% endfor %}",
    "method": "{% for m in messages %}{{ m.content.upper() }}{% endfor %}",
    "compared": "{% for m in messages %}{% if m.content == 'hi' %}hello{% endif %}{% endfor %}",
    "tested_joined": "{% for m in messages %}{% if '<think>' in m.content + 'x' %}T{% endif %}{% endfor %}",
    "tested_by_a_name": "{% set p = 'x' %}{% for m in messages %}{% if m.content.startswith(p) %}T{% endif %}{% endfor %}",
    "stripped_of_letters": "{% for m in messages %}{{ m.content.strip('ab') }}{% endfor %}",
    "split": "{% for m in messages %}{{ m.content.split('</think>')[-1] }}{% endfor %}",
    "sliced": "{% for m in messages %}{{ m.content[:3] }}{% endfor %}",
    "as_json": "{% for m in messages %}{{ m | tojson }}{% endfor %}",
    "list_as_json": "{{ messages | tojson }}",
    "get_method": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "computed_key": "{% set key = 'con' + 'tent' %}{% for m in messages %}{{ m[key] }}{% endfor %}",
    "captured": "{% for m in messages %}{% set x %}{{ m.content }}{% endset %}{{ x | length }}{% endfor %}",
    "macro_adds": "{% macro show(t) %}{{ t }}!{% endmacro %}{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "macro_measures": (
        "{% macro show(t) %}{% if t is string %}{{ t | length }}{% endif %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content) }}{% endfor %}"
    ),
    "macro_sets": (
        "{% macro show(t) %}{% set u = t %}{{ u }}{% endmacro %}{% for m in messages %}{{ show(m.content) }}{% endfor %}"
    ),
    "macro_second_argument": (
        "{% macro show(a, t) %}{{ a }}{% endmacro %}{% for m in messages %}{{ show('x', m.content) }}{% endfor %}"
    ),
    "macro_branch_untested": (
        "{% macro show(t, trimmed) %}{% if trimmed %}{{ t | trim }}{% else %}{{ t }}{% endif %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content, true) }}{% endfor %}"
    ),
    "trimmed_whole": "{% for m in messages %}{{ (m.content + '  x') | trim }}{% endfor %}",
    "namespace_printed": (
        "{% set ns = namespace(last='') %}{% for m in messages %}{% set ns.last = m.content %}{% endfor %}{{ ns }}"
    ),
    "namespace_passed_on": (
        "{% set ns = namespace(last='') %}{% for m in messages %}{% set ns.last = m.content %}{% endfor %}"
        "{% set other = ns %}{{ other.last }}"
    ),
    "namespace_tested": (
        "{% set ns = namespace(last='') %}{% for m in messages %}{% set ns.last = m.content %}{% endfor %}"
        "{% if ns.last.startswith('#') %}#{% endif %}"
    ),
    "neighbour_item": "{% for m in messages %}{{ loop.previtem }}{% endfor %}",
    "neighbour_of_another_loop": (
        "{% for m in messages %}{% for x in [1, 2] %}{{ loop.previtem.content }}{% endfor %}{% endfor %}"
    ),
    "neighbour_in_a_macro": (
        "{% macro show() %}{{ loop.previtem.content | length }}{% endmacro %}{% for m in messages %}{{ show() }}"
        "{% endfor %}"
    ),
    "measured_against_one": "{% for m in messages %}{% if m.content | length > 1 %}L{% endif %}{% endfor %}",
    "measured_equal": "{% for m in messages %}{% if m.content | trim | length == 3 %}L{% endif %}{% endfor %}",
    "measured_joined": "{% for m in messages %}{% if (m.content + 'x') | length > 0 %}L{% endif %}{% endfor %}",
    "clock_format_varies": (
        "{% set format = '%Y' %}{{ strftime_now(format) }}{% for m in messages %}{{ m.content }}{% endfor %}"
    ),
    "tool_branch_joined": (
        "{% for m in messages %}{% if m.role == 'tool' or m.role == 'user' %}{{ m.content | length }}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    ),
    "renamed": "{% set messages = [] %}{% for m in messages %}{{ m.content }}{% endfor %}",
    "filtered_list": "{% for m in messages | selectattr('role') %}{{ m.content }}{% endfor %}",
}


_CALLS = "{% for m in messages %}{% for c in m.tool_calls %}"
_END = "{% endfor %}{% endfor %}"

# Templates that print tool calls' texts and arguments only as they are or through tojson.
TOOL_VERBATIM = {
    "reassigned": (
        _CALLS + "{% if c.function is defined %}{% set c = c.function %}{% endif %}"
        "<{{ c.name }}>{{ c.arguments | tojson }}" + _END
    ),
    "string_or_json": (
        _CALLS + "{% set f = c['function'] if 'function' in c else c %}[{{ c.id }}|{{ c.type | trim }}]"
        "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
        "{{ f.name | trim | tojson }}" + _END + "{% for m in messages %}{{ m.content }}{% endfor %}"
    ),
    "indexed": (
        "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.name + '('"
        " + (m.tool_calls[0].function.arguments | tojson) + ')' }}{% for c in m.tool_calls %}{{ loop.index }}"
        "{% endfor %}{% else %}{{ m.role }}: {{ m.content }}{% endif %}{% endfor %}"
    ),
    "results": (
        "{% for m in messages %}{% if m.role == 'tool' %}[{{ m.tool_call_id | tojson }}] {{ m.content | tojson }}"
        "{% elif 'tool_calls' in m %}{{ m.tool_calls | length }} calls{% else %}{{ m.content }}{% endif %}{% endfor %}"
    ),
    # Arguments printed as they are: an object's text is Python's (``str()`` of the parsed value).
    "raw_arguments": _CALLS + "{{ c.function.arguments }}" + _END,
    # Arguments iterated, as Qwen 3 Coder writes them: one XML element per key.
    "argument_items": (
        _CALLS + "{% if c.function.arguments is mapping %}{% for k, v in c.function.arguments | items %}"
        "<{{ k }}>{% set v = v | tojson | safe if v is mapping or (v is sequence and v is not string) else v | string %}"
        "{{ v }}</{{ k | upper }}>{% if not loop.last %},{% endif %}{% endfor %}{% endif %}" + _END
    ),
    "argument_keys": (
        _CALLS + "{% set f = c.function %}{% if f.arguments is mapping %}{% for k in f.arguments %}"
        "{% set v = f.arguments[k] %}{{ '[' + k + '=' + (v | tojson) + ']' ~ v }}{% if v is number %}#{% endif %}"
        "{% if v %}!{% endif %}{% endfor %}{% endif %}" + _END
    ),
    "argument_pairs": (
        _CALLS + "{% if c.function.arguments is mapping %}{% for k, v in c.function.arguments.items() %}"
        "{{ k }}:{{ v if v is string else v | tojson }};{% endfor %}{% endif %}" + _END
    ),
    # GLM 4.5's: the call's function taken in its place, its arguments set to a name, and
    # dumped with ``ensure_ascii=False`` (tojson's default).
    "argument_set": _CALLS + "{% set a = c.function.arguments %}{{ a | tojson(ensure_ascii=False) }}" + _END,
    "argument_name_pairs": (
        _CALLS + "{% if c.function %}{% set c = c.function %}{% endif %}{% set args = c.arguments %}"
        "{% for k, v in args.items() %}<{{ k }}>{{ v | tojson(ensure_ascii=False) if v is not string else v }}"
        "{% endfor %}" + _END
    ),
}
# Templates that read tool calls some other way: refused.
TOOL_REFUSED = {
    "calls_as_json": "{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}",
    "argument_read": _CALLS + "{{ c.function.arguments.path }}" + _END,
    "argument_key": _CALLS + "{{ c.function.arguments['path'] }}" + _END,
    "argument_length": _CALLS + "{{ c.function.arguments | length }}" + _END,
    "argument_measured": _CALLS + "{% for k, v in c.function.arguments | items %}{{ v | length }}{% endfor %}" + _END,
    "argument_value_read": _CALLS + "{% for k, v in c.function.arguments | items %}{{ v.path }}{% endfor %}" + _END,
    "argument_value_compared": (
        _CALLS
        + "{% for k in c.function.arguments %}{% if c.function.arguments[k] == 1 %}1{% endif %}{% endfor %}"
        + _END
    ),
    "argument_value_added": _CALLS + "{% for k, v in c.function.arguments | items %}{{ 'x' + v }}{% endfor %}" + _END,
    "argument_markup_joined": (
        _CALLS + "{% for k, v in c.function.arguments | items %}{{ '<' + (v | tojson | safe) }}{% endfor %}" + _END
    ),
    "argument_value_dumped_with_options": (
        _CALLS + "{% for k, v in c.function.arguments | items %}{{ v | tojson(indent=1) }}{% endfor %}" + _END
    ),
    "argument_pairs_set": _CALLS + "{% set pairs = c.function.arguments | items %}{{ pairs | list }}" + _END,
    "argument_pairs_unpacked_otherwise": (
        _CALLS + "{% for pair in c.function.arguments | items %}{{ pair[1] }}{% endfor %}" + _END
    ),
    "argument_value_set_otherwise": (
        _CALLS + "{% for k, v in c.function.arguments | items %}{{ v }}{% endfor %}{% set v = 'x' %}" + _END
    ),
    "argument_value_is_a_text_too": (
        "{% for m in messages %}{% set v = m.content %}{% for c in m.tool_calls %}"
        "{% for k, v in c.function.arguments | items %}{{ v }}{% endfor %}" + _END
    ),
    "argument_neighbour": (
        _CALLS + "{% for k, v in c.function.arguments | items %}{{ loop.previtem }}{% endfor %}" + _END
    ),
    "argument_name_read": _CALLS + "{% set a = c.function.arguments %}{{ a.path }}" + _END,
    "argument_name_set_otherwise": _CALLS + "{% set a = c.function.arguments %}{% set a = 'x' %}{{ a }}" + _END,
    "argument_name_dumped_with_options": _CALLS + "{% set a = c.arguments %}{{ a | tojson(indent=1) }}" + _END,
    "json_escaped": _CALLS + "{{ c.function.arguments | tojson(ensure_ascii=True) }}" + _END,
    "name_upper": _CALLS + "{{ c.function.name | upper }}" + _END,
    "name_compared": _CALLS + "{% if c.function.name == 'x' %}X{% endif %}" + _END,
    "json_indented": _CALLS + "{{ c.function.arguments | tojson(indent=2) }}" + _END,
    "id_length": _CALLS + "{% if c.id | length != 9 %}{{ raise_exception('id') }}{% endif %}" + _END,
    "calls_set": "{% for m in messages %}{% set calls = m.tool_calls %}{{ calls[0].id }}{% endfor %}",
    "call_name_set_otherwise": "{% set c = 'x' %}" + _CALLS + "{{ c.id }}" + _END + "{{ c }}",
    "call_printed": "{% for m in messages %}{{ m.tool_calls[0] }}{% endfor %}",
    "result_id_length": "{% for m in messages %}{{ m.tool_call_id | length }}{% endfor %}",
    "call_looped": _CALLS + "{% for k in c %}{{ k }}{% endfor %}" + _END,
    "call_get": _CALLS + "{{ c.get('id') }}" + _END,
    "call_computed_key": _CALLS + "{% set k = 'id' %}{{ c[k] }}" + _END,
    "json_captured": _CALLS + "{% set x %}{{ c.function.arguments | tojson }}{% endset %}{{ x | length }}" + _END,
    "calls_filtered": "{% for m in messages %}{% for c in m.tool_calls | selectattr('id') %}{{ c.id }}{% endfor %}{% endfor %}",
    "json_tested": _CALLS + "{% if 'x' in c.function.arguments | tojson %}X{% endif %}" + _END,
    "calls_unpacked": "{% for m in messages %}{% for a, b in m.tool_calls %}{{ a }}{% endfor %}{% endfor %}",
    "call_as_value": _CALLS + "{{ c.function and c.function.name }}" + _END,
    "message_is_a_call": _CALLS + "{% set m = c %}" + _END,
}


@pytest.mark.parametrize("name", sorted(TOOL_VERBATIM))
def test_templates_printing_tool_calls_verbatim_are_accepted(name: str) -> None:
    assert verbatim_check(ChatTemplate.from_source(TOOL_VERBATIM[name]).syntax_tree, tools=True).refusal is None


@pytest.mark.parametrize("name", sorted(TOOL_REFUSED))
def test_templates_reading_tool_calls_otherwise_are_refused(name: str) -> None:
    template = ChatTemplate.from_source(TOOL_REFUSED[name])
    assert verbatim_check(template.syntax_tree, tools=True).refusal is not None
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"path": "x"}'}}
    chat = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert SkeletonRenders().render(chat, template, True, lambda messages: "") is None


@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_the_known_templates_are_checked_as_expected(name: str) -> None:
    refusal = SkeletonRenders().refusal(ChatTemplate.from_source(ALL_TEMPLATES[name]))
    assert (refusal is None) == (name in FILLED), refusal


def test_what_qwen3_asks_of_a_text_is_what_a_skeleton_needs_answered_no() -> None:
    """Qwen 3's template finds the last real query by testing texts for tool-response
    tags, splits an answer at </think> and strips newlines off it."""
    verdict = verbatim_check(ChatTemplate.from_source(ALL_TEMPLATES["qwen3"]).syntax_tree)
    assert set(verdict.tests) == {
        ("startswith", "<tool_response>"),
        ("endswith", "</tool_response>"),
        ("in", "</think>"),
    }
    # It strips newlines by name: where, its skeletons find per shape; not a verdict's refusal.
    assert verdict.strip_characters == "\n"
    assert verdict.admits("Which replica?") and verdict.admits("") and verdict.admits("\nWhich replica?\n")
    assert not verdict.admits("<tool_response>42") and not verdict.admits("a</think>b")
    assert not verdict.admits(" \n")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("{{ visible_text(m.content) }}\n{{-", "{{ visible_text(m) }}\n{{-"),  # the macro handed a message
        ("{{- item.text }}", "{{- item }}"),  # a macro printing a part whole
        ("visible_text(m.content).endswith", "visible_text(m.content).split"),  # its text read otherwise
        ("{%- set content = visible_text(m.content) %}", "{%- set content = visible_text(m.content[0]) %}"),
    ],
)
def test_glm_reads_each_text_through_a_macro_printing_its_parts(old: str, new: str) -> None:
    """GLM 4.5's template (content format: parts) prints every text through
    ``visible_text(m.content)``, which prints a list's text parts: the call is the text, and
    what the template asks of it is what a skeleton's texts must answer no to. The same
    template handing the macro something else, or reading the text otherwise, is refused."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["glm45"])
    assert template.content_format == "openai"
    verdict = verbatim_check(template.syntax_tree, parts=True)
    assert verdict.refusal is None and verdict.tests == (("endswith", "/nothink"), ("in", "</think>"))
    assert old in template.source
    changed = ChatTemplate.from_source(template.source.replace(old, new))
    assert verbatim_check(changed.syntax_tree, parts=True).refusal is not None


# Templates whose content format is a list of parts (vLLM hands each text as one part), which
# read a part's text verbatim.
PARTS_VERBATIM = {
    # Llama 4's shape: the system text taken from its first part, texts trimmed part by part.
    "llama4_parts": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% if messages[0]['content'] is string %}"
        "{% set system = messages[0]['content'] %}{% else %}{% set system = messages[0]['content'][0]['text'] %}"
        "{% endif %}<|header_start|>system<|header_end|>\n\n{{ system | trim }}<|eot|>"
        "{% set messages = messages[1:] %}{% endif %}{% for m in messages %}"
        "<|header_start|>{{ m['role'] }}<|header_end|>\n\n{% if m['content'] is string %}{{ m['content'] | trim }}"
        "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<|image|>"
        "{% elif part.type == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}<|eot|>{% endfor %}"
        "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
    ),
    "parts_counted": (
        "{% for m in messages %}{{ m.role }}({{ m.content | length }}):{% if m.content %}"
        "{% for p in m.content %}{% if 'text' in p and p.text is string %}{{ p.text }}{% endif %}{% endfor %}"
        "{% endif %};{% endfor %}"
    ),
}
# Templates reading a list of parts some other way: refused.
PARTS_REFUSED = {
    "parts_printed": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "parts_as_json": "{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
    "parts_set": "{% for m in messages %}{% set c = m.content %}{{ c[0].text }}{% endfor %}",
    "part_printed": "{% for m in messages %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "part_computed_key": "{% set k = 'text' %}{% for m in messages %}{{ m.content[0][k] }}{% endfor %}",
    "part_get": "{% for m in messages %}{% for p in m.content %}{{ p.get('text') }}{% endfor %}{% endfor %}",
    "part_text_measured": "{% for m in messages %}{{ m.content[0].text | length }}{% endfor %}",
    "parts_joined": "{% for m in messages %}{{ m.content | map(attribute='text') | join }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(PARTS_VERBATIM))
def test_templates_reading_parts_verbatim_are_accepted_for_plain_chats(name: str) -> None:
    template = ChatTemplate.from_source(PARTS_VERBATIM[name])
    assert template.content_format == "openai"
    assert verbatim_check(template.syntax_tree, parts=True).refusal is None
    # Tool results' content reaches the template as a text, other messages' as parts: read
    # where the message may be either, it is refused.
    assert verbatim_check(template.syntax_tree, tools=True, parts=True).refusal is not None


_PARTS = "{% for p in m.content %}{{ p.text }}{% endfor %}"
# Templates whose branches by role read a tool result's content as a text and the others'
# as parts (GLM's).
PARTS_TOOLS_VERBATIM = {
    "tool_branch": (
        "{% for m in messages %}{% if m.role == 'tool' %}<r>{{ m.content }}</r>{% elif m.content is string %}"
        "{{ m.content | upper }}{% else %}" + _PARTS + "{% endif %}{% endfor %}"
    ),
    "roles_listed": (
        "{% for m in messages %}{% if m.role in ['user', 'assistant', 'system', 'developer'] %}"
        + _PARTS
        + "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    ),
    "not_tool": "{% for m in messages %}{% if m.role != 'tool' %}"
    + _PARTS
    + "{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "tool_or_observation": (
        "{% for m in messages %}{% if m.role == 'tool' or m.role == 'observation' %}{{ m.content }}"
        "{% else %}" + _PARTS + "{% endif %}{% endfor %}"
    ),
    "guarded_by_and": "{% for m in messages %}{{ m.role == 'tool' and m.content }}{% endfor %}",
}
PARTS_TOOLS_REFUSED = {
    "any_role_looped": "{% for m in messages %}" + _PARTS + "{% endfor %}",
    "tool_branch_looped": "{% for m in messages %}{% if m.role == 'tool' %}" + _PARTS + "{% endif %}{% endfor %}",
    "user_branch_printed": "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}",
    "some_roles_excluded": "{% for m in messages %}{% if m.role != 'user' %}" + _PARTS + "{% endif %}{% endfor %}",
    "tool_or_user": "{% for m in messages %}{% if m.role == 'tool' or m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}",
    "either_measured": "{% for m in messages %}{{ m.content | length }}{% endfor %}",
    "macro_reads_a_message": (
        "{% macro show(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ show(m) }}{% endif %}{% endfor %}"
    ),
}


@pytest.mark.parametrize("name", sorted(PARTS_TOOLS_VERBATIM))
def test_parts_read_by_role_are_accepted_with_tool_results(name: str) -> None:
    template = ChatTemplate.from_source(PARTS_TOOLS_VERBATIM[name])
    assert verbatim_check(template.syntax_tree, tools=True, parts=True).refusal is None


@pytest.mark.parametrize("name", sorted(PARTS_TOOLS_REFUSED))
def test_parts_read_where_a_tool_result_may_be_are_refused(name: str) -> None:
    template = ChatTemplate.from_source(PARTS_TOOLS_REFUSED[name])
    assert verbatim_check(template.syntax_tree, tools=True, parts=True).refusal is not None


@pytest.mark.parametrize("name", sorted(PARTS_REFUSED))
def test_templates_reading_parts_otherwise_are_refused(name: str) -> None:
    assert verbatim_check(ChatTemplate.from_source(PARTS_REFUSED[name]).syntax_tree, parts=True).refusal is not None


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_templates_reading_texts_otherwise_are_refused(name: str) -> None:
    template = ChatTemplate.from_source(REFUSED[name])
    assert verbatim_check(template.syntax_tree).refusal is not None
    renders = SkeletonRenders()
    assert renders.render([{"role": "user", "content": "hi"}], template, True, lambda messages: "") is None


def test_a_name_tested_before_it_is_set_keeps_both_branches() -> None:
    """Inside a loop a name set from a text is undefined until its set runs, so ``is
    string`` of it proves nothing: the other branch, which measures a text, is read."""
    source = (
        "{% for m in messages %}{% if text is string %}{{ text }}{% else %}{{ m.content | length }}{% endif %}"
        "{% set text = m.content %}{% endfor %}"
    )
    assert verbatim_check(ChatTemplate.from_source(source).syntax_tree).refusal is not None
    straight = source.replace("text is string", "m.content is string")
    assert verbatim_check(ChatTemplate.from_source(straight).syntax_tree).refusal is None


def test_strips_are_left_to_the_skeleton() -> None:
    """A strip of whitespace named by the template is found slot by slot (its characters in
    the verdict); one of every whitespace character shows in the build render (the marks'
    pads taken off). None refuses a text with whitespace at an end at the verdict."""

    def verdict(expression: str) -> Verbatim:
        source = "{% for m in messages %}{{ " + expression + " }}{% endfor %}"
        return verbatim_check(ChatTemplate.from_source(source).syntax_tree)

    for expression, characters in (
        ("m.content.rstrip('\\n ')", "\n "),
        ("m.content.lstrip('\\u2003')", "\u2003"),
        ("m.content.strip('\\n').strip()", "\n"),
        ("m.content.strip()", ""),
    ):
        named = verdict(expression)
        assert named.refusal is None and named.strip_characters == characters, expression
        assert named.admits("x\n") and named.admits(" x") and not named.admits(" \n"), expression


def test_a_field_tested_for_being_defined_prunes_as_a_key_tested_in_the_message() -> None:
    """``message.tool_calls is defined`` is false for every plain message (a branch of tool
    calls that measures a text is not read); with tool calls it may be either; a dict's
    own attribute is always defined."""
    branch = "{% if m.content | trim | length > 1 %}{{ m.content }}{% endif %}"

    def verdict(test: str, *, tools: bool = False) -> Verbatim:
        source = (
            "{% for m in messages %}{% if " + test + " %}" + branch + "{% else %}{{ m.content }}{% endif %}{% endfor %}"
        )
        return verbatim_check(ChatTemplate.from_source(source).syntax_tree, tools=tools)

    assert verdict("m.tool_calls is defined").refusal is None
    assert verdict("m['reasoning'] is undefined and m.name is defined").refusal is None
    assert verdict("m.content is undefined").refusal is None
    assert verdict("m.tool_calls is defined", tools=True).refusal is not None
    assert verdict("m.items is defined").refusal is not None  # (dict.items)
    assert verdict("m.content is defined").refusal is not None
