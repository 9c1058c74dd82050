"""Chat template loading and rendering (transformers-compatible environment)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from smgd.assets import TINY_MODEL_DIR
from smgd.errors import ConfigError, InvalidRequest
from smgd.text.chat import ChatTemplate, load_chat_template, prepare_messages, prepare_tools
from smgd.text.tokenizer import load_tokenizer
from tests.chat_corpus import check as chat_corpus

USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


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
    assert prepare_messages([{"role": "user", "content": content}])[0]["content"] == "a\nb"


def test_text_parts_stay_parts_for_templates_that_walk_them() -> None:
    content = ["a", {"type": "text", "text": "b", "cache_control": {}}]
    got = prepare_messages([{"role": "user", "content": content}], parts=True)[0]["content"]
    assert got == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b", "cache_control": {}},
    ]
    tool = {"role": "tool", "content": content}
    assert prepare_messages([tool], parts=True)[0]["content"] == "a\nb"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    ],
)
def test_multimodal_part_is_a_clear_400(part: dict[str, object]) -> None:
    content = [{"type": "text", "text": "a"}, part]
    with pytest.raises(InvalidRequest, match="not supported: smgd serves text-only") as info:
        prepare_messages([USER, {"role": "user", "content": content}])
    assert str(part["type"]) in str(info.value)
    assert info.value.param == "messages[1].content[1].type"


def test_unknown_part_type_is_rejected_by_name() -> None:
    with pytest.raises(InvalidRequest, match="'thought'") as info:
        prepare_messages([{"role": "user", "content": [{"type": "thought", "text": "x"}]}])
    assert info.value.param == "messages[0].content[0].type"


def _call(**changes: object) -> list[dict[str, object]]:
    return [{"role": "assistant", "tool_calls": [{**CALL, **changes}]}]


AT_CALL = "messages[0].tool_calls[0]"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"content": "x"}], "messages[0].role"),
        (["x"], "messages[0]"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            "messages[0].content[0].text",
        ),
        ([{"role": "user", "content": [3]}], "messages[0].content[0]"),
        ([{"role": "user", "content": "x", "name": 3}], "messages[0].name"),
        ([{"role": "tool", "content": "x", "tool_call_id": 3}], "messages[0].tool_call_id"),
        ([{"role": "assistant", "content": "x", "reasoning": 3}], "messages[0].reasoning"),
        ([{"role": "assistant", "tool_calls": {}}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": ["x"]}], AT_CALL),
        (_call(type="custom"), f"{AT_CALL}.type"),
        (_call(id=None), f"{AT_CALL}.id"),
        (_call(function="f"), f"{AT_CALL}.function"),
        (_call(function={"arguments": "{}"}), f"{AT_CALL}.function.name"),
        (_call(function={"name": "f", "arguments": {}}), f"{AT_CALL}.function.arguments"),
    ],
)
def test_malformed_messages(messages: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        prepare_messages(messages)
    assert info.value.param == param


def test_null_content_is_empty() -> None:
    msgs = prepare_messages(
        [{"role": "assistant", "content": None}, {"role": "assistant", "tool_calls": [CALL]}]
    )
    assert [m["content"] for m in msgs] == ["", ""]
    assert prepare_messages([{"role": "user", "content": None}], parts=True)[0]["content"] == []


@pytest.mark.parametrize(
    ("arguments", "decoded"),
    [('{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}), ("", {}), ("{oops", {}), ("[1]", {})],
)
def test_tool_call_arguments_are_decoded(arguments: str, decoded: object) -> None:
    call = {**CALL, "function": {"name": "f", "arguments": arguments}}
    msg = prepare_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])[0]
    assert msg["tool_calls"] == [
        {"id": "call_1", "function": {"arguments": decoded, "name": "f"}, "type": "function"}
    ]


@pytest.mark.parametrize("calls", [[], None])
def test_empty_tool_calls_are_no_key(calls: list[object] | None) -> None:
    msg = prepare_messages([{"role": "assistant", "content": "x", "tool_calls": calls}])[0]
    assert "tool_calls" not in msg


def test_reasoning_from_either_field_reaches_both_keys() -> None:
    msgs = prepare_messages(
        [
            {"role": "assistant", "content": "a", "reasoning_content": "r1"},
            {"role": "assistant", "content": "b", "reasoning": "r2", "reasoning_content": "x"},
            {"role": "user", "content": "c", "reasoning_content": "dropped"},
        ]
    )
    assert [(m.get("reasoning"), m.get("reasoning_content")) for m in msgs] == [
        ("r1", "r1"), ("r2", "r2"), (None, None)
    ]  # fmt: skip


def test_developer_becomes_one_leading_system_message() -> None:
    msgs = [
        {"role": "system", "content": "S"},
        USER,
        {"role": "developer", "content": [{"type": "text", "text": "D1"}, "D2"]},
        {"role": "developer", "content": ""},
    ]  # fmt: skip
    assert prepare_messages(msgs, developer_role=False) == [
        {"role": "system", "content": "S\n\nD1\nD2"},
        {"role": "user", "content": "hi"},
    ]
    kept = prepare_messages(msgs, developer_role=True)
    assert [m["role"] for m in kept] == ["system", "user", "developer", "developer"]
    assert kept[2]["tools"] is None  # the key vLLM hands a template that knows the role
    alone = prepare_messages([{"role": "developer", "content": "D"}, USER], developer_role=False)
    assert alone == [{"role": "system", "content": "D"}, {"role": "user", "content": "hi"}]


def test_tools_take_vllms_shape() -> None:
    tools = [
        {"function": {"parameters": {"type": "object"}, "name": "a", "x": 1}},
        {"type": "function", "function": {"name": "b", "strict": True, "description": "d"}},
    ]
    a = {"name": "a", "description": None, "parameters": {"type": "object"}}
    b = {"name": "b", "description": "d", "parameters": None, "strict": True}
    assert prepare_tools(tools) == [
        {"type": "function", "function": a},
        {"type": "function", "function": b},
    ]
    assert prepare_tools(None) is None
    assert prepare_tools([]) is None


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ("x", "tools"),
        (["x"], "tools"),
        ([{"type": "custom", "custom": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"function": {"description": "d"}}], "tools[0].function.name"),
        ([{"function": {"name": "f", "description": 3}}], "tools[0].function.description"),
        ([{"function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters"),
        ([{"function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
    ],
)
def test_malformed_tools(tools: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        prepare_tools(tools)
    assert info.value.param == param


def test_raise_exception_is_invalid_request() -> None:
    tok = load_tokenizer(TINY_MODEL_DIR)
    with pytest.raises(InvalidRequest, match="Unknown role: wizard"):
        tok.render_chat([{"role": "wizard", "content": "x"}])


def test_tojson_keeps_order_and_does_not_escape() -> None:
    tok = load_tokenizer(TINY_MODEL_DIR)
    params = {"z": 1, "a": "Donne l'année <b>"}
    prompt = tok.render_chat([USER], tools=[{"function": {"name": "f", "parameters": params}}])
    assert '"parameters": {"z": 1, "a": "Donne l\'année <b>"}' in prompt


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
        t.render([USER], tools=[{"type": "function", "function": {"name": "f"}}])
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
    tools = [{"function": {"name": "a"}}, {"function": {"name": "b"}}]
    assert t.render([USER], tools=tools) == "T2"
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


# ------------------------------------------------------- the corpus, against vLLM's recording

CASES = chat_corpus.load_cases()
RECORDED = chat_corpus.load_expected()


def test_recording_covers_the_corpus() -> None:
    """expected.json was made from this corpus and these templates (else: rerun the script)."""
    assert sorted(RECORDED["cases"]) == sorted(c.id for c in CASES)
    for case in CASES:
        assert sorted(RECORDED["cases"][case.id]) == chat_corpus.template_names(), case.id
    assert sorted(RECORDED["templates"]) == chat_corpus.template_names()


@pytest.mark.parametrize("name", chat_corpus.template_names())
def test_template_reading_matches_vllm(name: str) -> None:
    errors = chat_corpus.check_template(name, RECORDED["templates"][name])
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", chat_corpus.template_names())
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_renders_as_vllm(case: chat_corpus.Case, name: str) -> None:
    errors = chat_corpus.check(case, name, RECORDED["cases"][case.id][name])
    assert not errors, "\n".join(errors)
