"""Chat templates: OpenAI ``messages`` → one prompt string, rendered like transformers does.

The Jinja environment is configured exactly as transformers' ``apply_chat_template`` so the
prompt bytes match what the model was trained on: ``ImmutableSandboxedEnvironment`` with
``trim_blocks``/``lstrip_blocks`` and ``loopcontrols``, an order-preserving non-escaping
``tojson``, the ``raise_exception`` and ``strftime_now`` globals, and a no-op
``{% generation %}`` block (transformers uses it to mark assistant tokens for training).

What a template is handed is what vLLM 0.32's chat server hands transformers for the same
request (tests/chat_corpus checks it byte for byte), so a model gets the same prompt behind
smgd as behind ``vllm serve``:

- ``messages``: each with ``role`` and ``content``, plus ``tool_calls`` (assistant, when there
  are any), ``reasoning`` and ``reasoning_content`` (assistant, from either field),
  ``tool_call_id`` (tool), ``name``; other fields are dropped. ``content`` is a string (text
  parts joined with newlines, ``""`` for null), or, for a template that walks a message's
  content itself (``{% for part in message.content %}``, directly or through a macro), a list
  of ``{"type": "text", "text": ...}`` parts. A tool message's content is always a string.
- a tool call's ``function.arguments`` decoded to a mapping (templates write
  ``arguments | tojson`` or iterate it, as transformers documents); arguments that are empty,
  not JSON or not a JSON object become ``{}`` so a bad turn in the history does not make the
  conversation unrecoverable.
- ``developer`` messages stay ``developer`` for a template that names the role; for others
  they become ``system`` messages, merged (with any other system message) into one system
  message at the start, their texts joined by a blank line.
- ``tools``: ``{"type": "function", "function": {"name", "description", "parameters"}}``
  each (``null`` for what the request left out, ``strict`` when it was given), or ``None``.
- ``documents=None``, ``add_generation_prompt``, the tokenizer's special tokens
  (``bos_token``, ``eos_token``...) and the request's ``chat_template_kwargs``.

Images, audio, video and files in a message are refused with a 400 naming the part
(:func:`refuse_media`): smgd serves text-only models, and turning media into model inputs is
the model's processor's work, which needs torch (docs/design.md, "Multimodal input").

Where the template comes from (first hit wins): an explicit override file, ``chat_template.jinja``
in the tokenizer dir, ``chat_template.json`` (``{"chat_template": ...}``), then
``tokenizer_config.json``'s ``chat_template`` (a string, or the list of ``{"name", "template"}``
where ``default`` is used, and ``tool_use`` when tools are passed and it exists).

Errors: a template that does not compile is the operator's problem (``ConfigError`` at load);
anything going wrong while rendering a request is the client's (``InvalidRequest``, 400), never
a 500 traceback. ``tools`` are accepted only when the template references ``tools``; otherwise
they would be silently dropped from the prompt, so the request is rejected instead.
"""

from __future__ import annotations

import json
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from smgd.errors import ConfigError, InvalidRequest
from smgd.textfile import read_utf8

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

__all__ = [
    "MEDIA_PARTS",
    "ChatTemplate",
    "load_chat_template",
    "prepare_messages",
    "prepare_tools",
    "refuse_media",
]

# Content part types that carry media: named in the 400, since no engine smgd fronts takes them.
MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image",
        "image_embeds",
        "input_audio",
        "audio_url",
        "audio_embeds",
        "video_url",
        "video_embeds",
        "file",
        "input_file",
    }
)


_MEDIA_REFUSAL = (
    "smgd serves text-only models; multimodal input (images, audio, video, files) needs the "
    "model's own processor, which runs on torch beside the engine, not in smgd "
    '(docs/design.md, "Multimodal input")'
)


def refuse_media(kind: object, at: str) -> None:
    """A 400 naming ``{at}.type`` when ``kind`` is a content part type that carries media."""
    if isinstance(kind, str) and kind in MEDIA_PARTS:
        raise InvalidRequest(
            f"{at}: {kind} content is not supported: {_MEDIA_REFUSAL}", param=f"{at}.type"
        )


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API declares it this way

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` token
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True
        )
        return body


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own `tojson` sorts keys and HTML-escapes; models were trained on this form.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise InvalidRequest(f"chat template rejected the request: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


# ------------------------------------------------------------------------------ messages


def prepare_messages(
    messages: object, *, parts: bool = False, developer_role: bool = True
) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and build what a chat template is handed.

    ``parts``: content as lists of text parts (for templates that walk content), else strings.
    ``developer_role``: the template knows the ``developer`` role; if not, developer messages
    become one system message at the start (see the module docstring).
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("`messages` must be a non-empty array", param="messages")
    out = [_message(message, f"messages[{i}]", parts) for i, message in enumerate(messages)]
    if not developer_role and any(m["role"] == "developer" for m in out):
        out = _merge_system([_as_system(m) if m["role"] == "developer" else m for m in out])
    return out


def _message(message: object, where: str, parts: bool) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequest(f"{where}.role must be a non-empty string", param=f"{where}.role")
    texts = _text_parts(message.get("content"), f"{where}.content")
    # A tool message's content is always a string (templates concatenate it).
    joined = "\n".join(part["text"] for part in texts)
    out: dict[str, Any] = {"role": role, "content": texts if parts and role != "tool" else joined}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            prepared = _tool_calls(calls, f"{where}.tool_calls")
            if prepared:  # `[]` is no call: templates test for the key or its truth
                out["tool_calls"] = prepared
        reasoning = message.get("reasoning")
        if reasoning is None:  # what smgd returns, and clients send back
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            _string(reasoning, f"{where}.reasoning")
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        call_id = message["tool_call_id"]
        if call_id is not None:
            _string(call_id, f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    name = message.get("name")
    if name is not None:
        out["name"] = _string(name, f"{where}.name")
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string", param=where)
    return value


def _text_parts(content: object, where: str) -> list[dict[str, Any]]:
    """Content as ``{"type": "text", "text": ...}`` parts (a part's other keys are kept)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or an array of content parts", param=where)
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(part, str):
            out.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        kind = part.get("type")
        if kind in ("text", "refusal"):
            text = _string(part.get(kind), f"{at}.{kind}")
            extra = {k: v for k, v in part.items() if k not in ("type", "text", "refusal")}
            out.append({"type": "text", "text": text, **extra})
        else:
            refuse_media(kind, at)
            raise InvalidRequest(
                f"{at}: content part type {kind!r} is not supported (text only)",
                param=f"{at}.type",
            )
    return out


def _tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be an array", param=where)
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        if call.get("type") != "function":
            raise InvalidRequest(f'{at}.type must be "function"', param=f"{at}.type")
        call_id = _string(call.get("id"), f"{at}.id")
        function = call.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{at}.function must be an object", param=f"{at}.function")
        name = _string(function.get("name"), f"{at}.function.name")
        arguments = _string(function.get("arguments"), f"{at}.function.arguments")
        # The key order is the one vLLM's request model gives; templates may `tojson` these.
        decoded = {"arguments": _decode_arguments(arguments), "name": name}
        decoded.update((k, v) for k, v in function.items() if k not in decoded)
        entry: dict[str, Any] = {"id": call_id, "function": decoded, "type": "function"}
        entry.update((k, v) for k, v in call.items() if k not in entry)
        out.append(entry)
    return out


def _decode_arguments(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    out = {**message, "role": "system"}
    out.pop("tools", None)
    return out


def _merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All system messages as one at the start (some templates take it only there)."""
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    scattered = False
    for i, message in enumerate(messages):
        if message["role"] != "system":
            rest.append(message)
            continue
        scattered = scattered or i > 0 or bool(texts)
        content = message["content"]
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        if content:
            texts.append(content)
    if not scattered:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def prepare_tools(tools: object) -> list[dict[str, Any]] | None:
    """Validate the request's ``tools``; the function tools as templates are handed them."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("`tools` must be an array of objects", param="tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise InvalidRequest(
                f'{at}.type: only "function" tools are supported', param=f"{at}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{at}.function must be an object", param=f"{at}.function")
        name = _string(function.get("name"), f"{at}.function.name")
        description = function.get("description")
        if description is not None:
            _string(description, f"{at}.function.description")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(
                f"{at}.function.parameters must be an object (a JSON Schema)",
                param=f"{at}.function.parameters",
            )
        spec: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
        strict = function.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise InvalidRequest(
                    f"{at}.function.strict must be a boolean", param=f"{at}.function.strict"
                )
            spec["strict"] = strict
        out.append({"type": "function", "function": spec})
    return out or None


# ------------------------------------------------------------------- template inspection


def walks_content(source: str) -> bool:
    """Whether a template iterates over a message's content, so it is handed lists of parts.

    The loops that count: ``{% for x in m.content %}`` (or ``m['content']``, filtered or
    sliced) where ``m`` is the variable of a loop over ``messages`` (or over a variable set
    from it); a loop, inside a macro, over a parameter that some call binds to such a
    ``m.content``; and a loop over a variable named ``content`` outside macros. This is the
    rule vLLM applies to pick its "openai" content format, so both hand a template the same
    shape.
    """
    ast = _ENV.parse(source)
    messages = _aliases(ast, "messages")
    items = {
        loop.target.name
        for loop in ast.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, messages)
    }
    if any(_reads(loop.iter, items, "content") for loop in ast.find_all(jinja2.nodes.For)):
        return True
    in_macros: set[int] = set()
    for macro in ast.find_all(jinja2.nodes.Macro):
        loops = list(macro.find_all(jinja2.nodes.For))
        in_macros.update(id(loop) for loop in loops)
        bound = _content_params(ast, macro, items)
        if any(
            isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in bound for loop in loops
        ):
            return True
    return any(
        id(loop) not in in_macros
        and isinstance(loop.iter, jinja2.nodes.Name)
        and loop.iter.name == "content"
        for loop in ast.find_all(jinja2.nodes.For)
    )


def _aliases(ast: jinja2.nodes.Template, name: str) -> set[str]:
    """``name`` and every variable ``{% set %}`` from it (or a slice or filter of one)."""
    found = {name}
    queue = deque([name])
    while queue:
        source = queue.popleft()
        for assign in ast.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and target.name not in found
                and _reads(assign.node, {source})
            ):
                found.add(target.name)
                queue.append(target.name)
    return found


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """``node`` is one of ``names`` (or its ``key`` item), through filters, tests and slices."""
    while (inner := _unwrapped(node)) is not None:
        node = inner
    if key is not None:
        container = _item_of(node, key)
        if container is None:
            return False
        node = container
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _unwrapped(node: jinja2.nodes.Node) -> jinja2.nodes.Node | None:
    """What a filter, a test or a slice is applied to (``x`` of ``x | f``, ``x[1:]``)."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        inner: jinja2.nodes.Node | None = node.node
        return inner
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return node.node
    return None


def _item_of(node: jinja2.nodes.Node, key: str) -> jinja2.nodes.Node | None:
    """``x`` of ``x.key`` or ``x['key']``."""
    if isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
        return node.node
    if (
        isinstance(node, jinja2.nodes.Getitem)
        and isinstance(node.arg, jinja2.nodes.Const)
        and node.arg.value == key
    ):
        return node.node
    return None


def _content_params(
    ast: jinja2.nodes.Template, macro: jinja2.nodes.Macro, items: set[str]
) -> set[str]:
    """The parameters of ``macro`` that some call passes a message's content."""
    params = [arg.name for arg in macro.args]
    bound: set[str] = set()
    for call in _calls_of(ast, macro.name):
        for param, arg in zip(params, call.args, strict=False):
            if _reads(arg, items, "content"):
                bound.add(param)
        for keyword in call.kwargs:
            if keyword.key in params and _reads(keyword.value, items, "content"):
                bound.add(keyword.key)
    return bound


def _calls_of(ast: jinja2.nodes.Template, name: str) -> Iterator[jinja2.nodes.Call]:
    for call in ast.find_all(jinja2.nodes.Call):
        if isinstance(call.node, jinja2.nodes.Name) and call.node.name == name:
            yield call


def names_developer(source: str) -> bool:
    """Whether a template names the ``developer`` role (as a quoted string, as vLLM checks)."""
    return '"developer"' in source or "'developer'" in source


# ------------------------------------------------------------------------------ templates


class _Compiled:
    """One named template and what it asks of the messages it is handed."""

    def __init__(self, name: str, source: str, origin: str) -> None:
        try:
            self.template = _ENV.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(_ENV.parse(source))
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(
                f"chat template {name!r} from {origin} does not compile: "
                f"{exc.message} (line {exc.lineno})"
            ) from exc
        self.tools = "tools" in variables
        self.parts = walks_content(source)
        self.developer = names_developer(source)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(
        self,
        templates: Mapping[str, str] | str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        origin: str = "<string>",
    ) -> None:
        named = {"default": templates} if isinstance(templates, str) else dict(templates)
        if "default" not in named:
            raise ConfigError(
                f"chat template list in {origin} has no 'default' entry (names: {sorted(named)})"
            )
        self.origin = origin
        self._special = dict(special_tokens or {})
        self._compiled = {name: _Compiled(name, source, origin) for name, source in named.items()}

    @property
    def supports_tools(self) -> bool:
        return any(c.tools for c in self._compiled.values())

    def render(
        self,
        messages: object,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` (raw OpenAI form; validated and prepared here) to a prompt.

        ``extra`` are additional template variables (``chat_template_kwargs`` such as
        ``enable_thinking``); they cannot override ``messages``, ``tools``, ``documents`` or
        the flag.
        """
        prepared_tools = prepare_tools(tools)
        name = "tool_use" if prepared_tools and "tool_use" in self._compiled else "default"
        compiled = self._compiled[name]
        if prepared_tools and not compiled.tools:
            raise InvalidRequest("this model's chat template does not support tools", param="tools")
        # The request's value as it came: prepare_messages refuses anything but a non-empty
        # array (a `list()` of it here turned null or a number into a TypeError, a 500).
        prepared = prepare_messages(
            messages, parts=compiled.parts, developer_role=compiled.developer
        )
        context: dict[str, Any] = {**self._special, **extra}
        context.update(
            messages=prepared,
            tools=prepared_tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return compiled.template.render(context)
        except InvalidRequest:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidRequest(
                f"chat template error: {exc.message or type(exc).__name__}", param="messages"
            ) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # A template doing `'x' + message['content']` on a non-string, indexing an
            # empty list... is fed bad input by the request, so it is the client's error.
            raise InvalidRequest(
                f"chat template could not render these messages: {type(exc).__name__}: {exc}",
                param="messages",
            ) from exc


def _template_from_config(config: Mapping[str, Any], origin: str) -> Mapping[str, str] | str | None:
    raw = config.get("chat_template")
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named: dict[str, str] = {}
        for entry in raw:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ConfigError(f"malformed chat_template list entry in {origin}")
            named[entry["name"]] = entry["template"]
        return named
    raise ConfigError(f"chat_template in {origin} must be a string or a list")


def _read_template(path: Path) -> str:
    return read_utf8(path, what="chat template ", hint="save the template as UTF-8")


def load_chat_template(
    tokenizer_dir: Path,
    tokenizer_config: Mapping[str, Any],
    *,
    override: str | Path | None = None,
    special_tokens: Mapping[str, str] | None = None,
) -> ChatTemplate | None:
    """Find and compile the model's chat template, or ``None`` if it has none."""
    if override is not None:
        path = Path(override)
        return ChatTemplate(_read_template(path), special_tokens=special_tokens, origin=str(path))
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(
            _read_template(jinja_file), special_tokens=special_tokens, origin=str(jinja_file)
        )
    candidates: list[tuple[Mapping[str, Any], str]] = []
    json_file = tokenizer_dir / "chat_template.json"
    if json_file.is_file():
        try:
            candidates.append((json.loads(json_file.read_text(encoding="utf-8")), str(json_file)))
        except (ValueError, OSError) as exc:
            raise ConfigError(f"cannot parse {json_file}: {exc}") from exc
    candidates.append((tokenizer_config, str(tokenizer_dir / "tokenizer_config.json")))
    for config, origin in candidates:
        found = _template_from_config(config, origin)
        if found is not None:
            return ChatTemplate(found, special_tokens=special_tokens, origin=origin)
    return None
