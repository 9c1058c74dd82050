"""Chat templates: OpenAI ``messages`` → one prompt string, rendered like transformers does.

The Jinja environment is configured exactly as transformers' ``apply_chat_template`` so the
prompt bytes match what the model was trained on: ``ImmutableSandboxedEnvironment`` with
``trim_blocks``/``lstrip_blocks`` and ``loopcontrols``, an order-preserving non-escaping
``tojson``, the ``raise_exception`` and ``strftime_now`` globals, and a no-op
``{% generation %}`` block (transformers uses it to mark assistant tokens for training).

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

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["ChatTemplate", "load_chat_template", "normalize_messages"]


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


def normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and flatten list-of-parts content to a string.

    Text parts are joined with newlines (as vLLM does for string-content templates); any other
    part type (images, audio, files...) is rejected by name since no engine here takes them.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("`messages` must be a non-empty array", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(
                f"messages[{i}].role must be a non-empty string", param=f"messages[{i}].role"
            )
        msg = dict(message)
        msg["content"] = _flatten_content(message.get("content"), i, message)
        out.append(msg)
    return out


def _flatten_content(content: object, i: int, message: Mapping[str, Any]) -> str | None:
    if isinstance(content, str):
        return content
    if content is None:
        # An assistant turn that only carries tool calls has null content; templates that
        # render tool calls test for it, others concatenate, so "" is the safe default.
        return None if message.get("tool_calls") else ""
    if not isinstance(content, list):
        raise InvalidRequest(
            f"messages[{i}].content must be a string or an array of content parts",
            param=f"messages[{i}].content",
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = part.get("type")
        if kind != "text":
            raise InvalidRequest(
                f"{where}: content part type {kind!r} is not supported (text only)",
                param=f"{where}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
        texts.append(text)
    return "\n".join(texts)


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
        self._compiled: dict[str, jinja2.Template] = {}
        self._tools: dict[str, bool] = {}
        for name, source in named.items():
            try:
                self._compiled[name] = _ENV.from_string(source)
                variables = jinja2.meta.find_undeclared_variables(_ENV.parse(source))
            except jinja2.TemplateSyntaxError as exc:
                raise ConfigError(
                    f"chat template {name!r} from {origin} does not compile: "
                    f"{exc.message} (line {exc.lineno})"
                ) from exc
            self._tools[name] = "tools" in variables

    @property
    def supports_tools(self) -> bool:
        return any(self._tools.values())

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` (raw OpenAI form; validated and flattened here) to a prompt.

        ``extra`` are additional template variables (``chat_template_kwargs`` such as
        ``enable_thinking``); they cannot override ``messages``, ``tools`` or the flag.
        """
        normalized = normalize_messages(list(messages))
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
        ):
            raise InvalidRequest("`tools` must be an array of objects", param="tools")
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        if tools and not self._tools[name]:
            raise InvalidRequest("this model's chat template does not support tools", param="tools")
        context: dict[str, Any] = {**self._special, **extra}
        context.update(
            messages=normalized,
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return self._compiled[name].render(context)
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
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read chat template {path}: {exc.strerror}") from exc
        return ChatTemplate(source, special_tokens=special_tokens, origin=str(path))
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(
            jinja_file.read_text(encoding="utf-8"),
            special_tokens=special_tokens,
            origin=str(jinja_file),
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
