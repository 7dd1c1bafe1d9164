"""Rendering a model's own Jinja chat template the way transformers (and so vLLM) does.

vLLM renders chats with ``tokenizer.apply_chat_template(..., tokenize=False)``; transformers
compiles the template in an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` tag, its own
``tojson`` filter (no HTML escaping, non-ASCII kept) and the ``raise_exception`` and
``strftime_now`` globals, and passes the tokenizer's special tokens (``bos_token``, ...) as
variables. This module sets up the same environment, so a template renders to the same text
here without importing transformers. Templates are never re-implemented.

It also tells which content format a template expects, as vLLM detects it: ``"openai"`` when
the template loops over a message's ``content`` (a list of typed parts), else ``"string"``.
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

ContentFormat = Literal["string", "openai"]

# transformers marks the end of the final message with this tag to cut the render there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The chat template rejected the request (``raise_exception``) or could not render it."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    Templates that support assistant-token masks use this tag; only transformers' mask
    bookkeeping gives it meaning, which routing does not need.
    """

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it a set attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


# What json.dumps builds on every call with these arguments, built once (it keeps no state
# between calls): templates dump each tool call's name and arguments, and building the
# encoder cost more than the dump.
_PLAIN_ENCODER = json.JSONEncoder(ensure_ascii=False)


class DumpedAs:
    """A value the ``tojson`` filter prints as its ``json_text``: a skeleton's stand-in for a
    tool call's arguments (:mod:`kvroute.tokenizer_index.render_skeleton`)."""

    json_text: str = ""


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """The templates' ``tojson`` filter."""
    # Same signature and defaults as transformers' filter: Jinja's built-in one escapes HTML.
    if not ensure_ascii and indent is None and separators is None and not sort_keys:
        if isinstance(value, DumpedAs):
            return value.json_text
        return _PLAIN_ENCODER.encode(value)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    """The template global transformers and vLLM provide: the local time, formatted."""
    return datetime.now().strftime(format)


# What a plain dict answers as an attribute; any other name a template reads off a dict
# (``message.role``) is one of its keys or undefined.
_DICT_ATTRIBUTES = frozenset(dir(dict))
# Objects whose public attributes the general check always finds safe: not functions,
# methods, types, frames or generators, and not known mutable containers.
_PUBLIC_ATTRIBUTES_SAFE = (LoopContext, str, Namespace)
_METHOD_TYPES = (types.MethodType, types.BuiltinMethodType)
_FORMAT_METHODS = frozenset({"format", "format_map"})


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, answering its most frequent questions without asking them.

    Templates read ``message.role``, ``loop.last``, ``ns.flag`` and ``content.startswith``
    once or more per message, and the general paths cost more than the rest of that
    message's render: a dict's key read as an attribute first raises and catches
    ``AttributeError``, and every other read runs the safety check (internal attribute?
    does it mutate a known container, through four ABC instance checks?). The shortcuts
    give the answers the general paths give (``tests/tokenizer_index/
    test_chat_template_sandbox.py`` compares them).
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if kind in _PUBLIC_ATTRIBUTES_SAFE and not attribute.startswith("_"):
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                return super().getattr(obj, attribute)
            # A str's format method (or one kept in a namespace) goes the general way,
            # which sandboxes its formatting (at the read since Jinja 3.1.5, at the call before).
            if isinstance(value, _METHOD_TYPES) and value.__name__ in _FORMAT_METHODS:
                return super().getattr(obj, attribute)
            return value
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if type(obj) in _PUBLIC_ATTRIBUTES_SAFE:
            return not attr.startswith("_")
        return super().is_safe_attribute(obj, attr, value)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


_ENVIRONMENT = _environment()


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once per distinct source text."""
    try:
        return compile_syntax_tree(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"invalid chat template: {exc}") from exc


def compile_syntax_tree(tree: str | jinja2.nodes.Template) -> jinja2.Template:
    """A chat template, or one built from parts of a parsed one, compiled in the sandbox."""
    template = _ENVIRONMENT.from_string(tree)
    # A template's globals are a ChainMap over the environment's, copied key by key in
    # Python into every render's context; one plain dict (they never change) copies in C.
    template.globals = dict(template.globals)
    return template


def render_compiled(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """Render a compiled chat template (or part of one); whatever it raises is the request's
    fault, a :class:`ChatTemplateError`."""
    try:
        return template.render(variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    except Exception as exc:  # the template is code: whatever it raises is the request's fault
        raise ChatTemplateError(f"chat template failed on this request: {exc!r}") from exc


# --- content format detection ----------------------------------------------------------------


def _unwrap(node: jinja2.nodes.Node | None) -> jinja2.nodes.Node | None:
    """Strip the filters, tests and slices around a variable: ``messages[1:] | reverse``."""
    while True:
        if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _reads_variable(node: jinja2.nodes.Node, names: set[str]) -> bool:
    inner = _unwrap(node)
    return isinstance(inner, jinja2.nodes.Name) and inner.ctx == "load" and inner.name in names


def _reads_content_of(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """True for ``m.content`` / ``m['content']`` (possibly filtered or sliced) with m in names."""
    inner = _unwrap(node)
    if isinstance(inner, jinja2.nodes.Getattr):
        return inner.attr == "content" and _reads_variable(inner.node, names)
    if isinstance(inner, jinja2.nodes.Getitem):
        key = inner.arg
        return isinstance(key, jinja2.nodes.Const) and key.value == "content" and _reads_variable(inner.node, names)
    return False


def detect_content_format(source: str) -> ContentFormat:
    """``"openai"`` if the template iterates over a message's content parts, else ``"string"``.

    Follows vLLM's detection: find the variables that hold the message list (``messages`` and
    anything assigned from it), the loop variables over them, and a loop over such a
    variable's ``content``.
    """
    try:
        tree = _ENVIRONMENT.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists = {"messages"}
    grew = True
    while grew:
        grew = False
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and target.name not in lists
                and _reads_variable(assign.node, lists)
            ):
                lists.add(target.name)
                grew = True
    loops = list(tree.find_all(jinja2.nodes.For))
    message_names = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name) and _reads_variable(loop.iter, lists)
    }
    if any(_reads_content_of(loop.iter, message_names) for loop in loops):
        return "openai"
    return "string"


# --- rendering -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTemplate:
    """One compiled chat template and the content format it expects."""

    source: str
    content_format: ContentFormat
    _template: jinja2.Template = field(repr=False, compare=False)

    @classmethod
    def from_source(cls, source: str) -> ChatTemplate:
        """Compile ``source`` (cached) and detect its content format."""
        return cls(source=source, content_format=detect_content_format(source), _template=compile_template(source))

    @cached_property
    def syntax_tree(self) -> jinja2.nodes.Template:
        """The template parsed (what :mod:`kvroute.tokenizer_index.template_prefix` reads)."""
        return _ENVIRONMENT.parse(self.source)

    def render(
        self,
        conversation: list[dict[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
        program: jinja2.Template | None = None,
    ) -> str:
        """Render a conversation (already in the template's content format) to prompt text.

        ``variables`` are the extra template variables: the tokenizer's special tokens, then
        the request's ``chat_template_kwargs``. With ``continue_final_message`` the text ends
        inside the last message, open for the model to continue (transformers' tag method);
        the last message is modified in place, so pass a conversation you own. ``program``
        renders in place of the template (one built from it, given the same variables).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        final_text = _tag_final_message(conversation, self.source) if continue_final_message else None
        arguments = {
            "messages": conversation,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        if variables:
            if clash := arguments.keys() & variables.keys():
                raise ChatTemplateError(f"chat template variables may not set {', '.join(sorted(clash))}")
            arguments.update(variables)
        rendered = render_compiled(self._template if program is None else program, arguments)
        if final_text is not None:
            rendered = _cut_at_tag(rendered, final_text)
        return rendered


def _tag_final_message(conversation: list[dict[str, Any]], source: str) -> str:
    """Append transformers' continuation tag to the last message's text; return that text."""
    if not conversation:
        raise ValueError("continue_final_message needs at least one message")
    final = conversation[-1]
    content = final.get("content")
    if content is None:
        raise ValueError("continue_final_message is set but the final message has no content")
    if "content" not in source:
        raise ValueError("continue_final_message is set but the chat template does not read 'content'")
    if isinstance(content, list):
        parts = [dict(part) if isinstance(part, Mapping) else part for part in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                final["content"] = parts
                return text
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    final["content"] = content + _CONTINUE_TAG
    return content


def _cut_at_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("continue_final_message: the chat template dropped part of the final message")
    position = rendered.rindex(tag)
    if rendered[position : position + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:position]
    return rendered[:position].rstrip()
