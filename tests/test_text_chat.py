"""Chat template loading and rendering (transformers-compatible environment)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from smgd.assets import TINY_MODEL_DIR
from smgd.errors import ConfigError, InvalidRequest
from smgd.text.chat import ChatTemplate, load_chat_template, normalize_messages
from smgd.text.tokenizer import load_tokenizer

USER = {"role": "user", "content": "hi"}


def test_tiny_template_renders_chatml() -> None:
    tok = load_tokenizer(TINY_MODEL_DIR)
    prompt = tok.render_chat([{"role": "system", "content": "Be brief."}, USER])
    assert prompt == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tok.render_chat([USER], add_generation_prompt=False)
    assert without == "<s><|im_start|>user\nhi<|im_end|>\n"


def test_text_parts_are_joined() -> None:
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert normalize_messages([{"role": "user", "content": content}])[0]["content"] == "a\nb"


def test_non_text_part_is_rejected_by_name() -> None:
    content = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(InvalidRequest, match="image_url") as info:
        normalize_messages([USER, {"role": "user", "content": content}])
    assert info.value.param == "messages[1].content[1].type"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"content": "x"}], "messages[0].role"),
        (["x"], "messages[0]"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
    ],
)
def test_malformed_messages(messages: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        normalize_messages(messages)
    assert info.value.param == param


def test_null_content_becomes_empty_unless_tool_calls() -> None:
    msgs = normalize_messages(
        [
            {"role": "assistant", "content": None},
            {"role": "assistant", "content": None, "tool_calls": [{}]},
        ]
    )
    assert [m["content"] for m in msgs] == ["", None]


def test_raise_exception_is_invalid_request() -> None:
    tok = load_tokenizer(TINY_MODEL_DIR)
    with pytest.raises(InvalidRequest, match="Unknown role: wizard"):
        tok.render_chat([{"role": "wizard", "content": "x"}])


def test_tojson_keeps_order_and_does_not_escape() -> None:
    tok = load_tokenizer(TINY_MODEL_DIR)
    tool = {"z": 1, "a": "Donne l'année <b>"}
    prompt = tok.render_chat([USER], tools=[tool])
    assert '{"z": 1, "a": "Donne l\'année <b>"}' in prompt


def test_tojson_indent() -> None:
    t = ChatTemplate("{{ messages[0] | tojson(indent=2) }}")
    assert t.render([USER]) == json.dumps(USER, indent=2)


def test_generation_block_is_a_no_op() -> None:
    src = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert ChatTemplate(src).render([USER, USER]) == "[hi][hi]"


def test_loopcontrols_and_trim_blocks() -> None:
    src = (
        "{% for m in messages %}\n{% if loop.index0 == 1 %}{% break %}{% endif %}\n"
        "{{ m.content }}\n{% endfor %}"
    )
    assert ChatTemplate(src).render([USER, {"role": "user", "content": "b"}]) == "hi\n"


def test_strftime_now_and_extra_variables() -> None:
    t = ChatTemplate("{{ strftime_now('%Y') | length }}-{{ enable_thinking }}-{{ bos_token }}")
    assert t.render([USER], enable_thinking=True) == "4-True-"


def test_special_tokens_are_template_variables() -> None:
    t = ChatTemplate("{{ eos_token }}", special_tokens={"eos_token": "</s>"})
    assert t.render([USER]) == "</s>"


def test_tools_rejected_when_template_ignores_them() -> None:
    t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not t.supports_tools
    assert t.render([USER], tools=None) == "hi"
    with pytest.raises(InvalidRequest) as info:
        t.render([USER], tools=[{"type": "function"}])
    assert info.value.param == "tools"


def test_tools_must_be_objects() -> None:
    tok = load_tokenizer(TINY_MODEL_DIR)
    with pytest.raises(InvalidRequest, match="array of objects"):
        tok.render_chat([USER], tools=["x"])  # type: ignore[list-item]


def test_render_errors_are_invalid_request() -> None:
    # `+` on a list content ... fails inside the template: the client's input, not a 500.
    t = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(InvalidRequest, match="chat template"):
        t.render([USER])
    undefined = ChatTemplate("{{ messages[0].nope.deeper }}")
    with pytest.raises(InvalidRequest, match="chat template error"):
        undefined.render([USER])


def test_sandbox_blocks_attribute_escape() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequest):
        t.render([USER])
    mutate = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(InvalidRequest):
        mutate.render([USER])


def test_syntax_error_is_config_error() -> None:
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_named_templates_default_and_tool_use(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "default", "template": "D{{ messages | length }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
        ]
    }
    t = load_chat_template(tmp_path, config)
    assert t is not None
    assert t.render([USER]) == "D1"
    assert t.render([USER], tools=[{"a": 1}, {"b": 2}]) == "T2"
    with pytest.raises(ConfigError, match="no 'default'"):
        load_chat_template(tmp_path, {"chat_template": [{"name": "x", "template": "y"}]})


def test_template_source_precedence(tmp_path: Path) -> None:
    shutil.copytree(TINY_MODEL_DIR, tmp_path / "m")
    model = tmp_path / "m"
    (model / "chat_template.jinja").write_text("jinja-file")
    assert load_tokenizer(model).render_chat([USER]) == "jinja-file"
    override = tmp_path / "override.jinja"
    override.write_text("override")
    assert load_tokenizer(model, chat_template=override).render_chat([USER]) == "override"
    with pytest.raises(ConfigError, match="cannot read chat template"):
        load_tokenizer(model, chat_template=tmp_path / "missing.jinja")


def test_chat_template_json_file(tmp_path: Path) -> None:
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from-json"}))
    t = load_chat_template(tmp_path, {"chat_template": "from-config"})
    assert t is not None
    assert t.render([USER]) == "from-json"
    assert load_chat_template(tmp_path / "nowhere", {}) is None
