"""Structured output: every spelling a client sends -> one normalized constraint, and its refusals.

The engine forms (SGLang's json_schema/regex/ebnf, vLLM's structured_outputs map, TokenSpeed's
fields) are checked against each engine's own encoder in tests/test_wire_*.py (vectors).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from smgd.errors import InvalidRequest
from smgd.sampling import MAX_SCHEMA_NESTING, from_native, from_openai
from smgd.wire import common
from smgd.wire.common import (
    JSON_OBJECT_SCHEMA,
    Structured,
    StructuredKind,
    choice_regex,
    grammar_fields,
    schema_text,
)
from smgd.wire.vllm import encode as vllm_encode

CTX = {"prompt_len": 10, "context_len": 100, "vocab_size": 1024, "eos_token_ids": (2,)}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
JSON, OBJECT, REGEX, CHOICE, GRAMMAR = (
    StructuredKind.JSON,
    StructuredKind.JSON_OBJECT,
    StructuredKind.REGEX,
    StructuredKind.CHOICE,
    StructuredKind.GRAMMAR,
)


def openai(body: dict[str, Any], *, chat: bool = True) -> Structured | None:
    return from_openai(body, chat=chat, **CTX)[0].structured  # type: ignore[arg-type]


def native(sp: dict[str, Any]) -> Structured | None:
    return from_native(sp, **CTX)[0].structured  # type: ignore[arg-type]


def refused(body: dict[str, Any], *, is_native: bool = False) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        if is_native:
            native(body)
        else:
            openai(body)
    return info.value


def _json_schema(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, **extra}}


@pytest.mark.parametrize(
    ("body", "want"),
    [
        # OpenAI response_format
        ({"response_format": _json_schema(SCHEMA, strict=True)},
         Structured(kind=JSON, param="response_format", spec=SCHEMA)),
        ({"response_format": _json_schema(SCHEMA, strict=False, description="a city")},
         Structured(kind=JSON, param="response_format", spec=SCHEMA)),
        ({"response_format": {"type": "json_object"}},
         Structured(kind=OBJECT, param="response_format")),
        # vLLM's structured_outputs
        ({"structured_outputs": {"json": SCHEMA}},
         Structured(kind=JSON, param="structured_outputs.json", spec=SCHEMA)),
        ({"structured_outputs": {"json": '{"type": "string"}'}},
         Structured(kind=JSON, param="structured_outputs.json", spec='{"type": "string"}')),
        ({"structured_outputs": {"regex": "[0-9]+", "json": None}},
         Structured(kind=REGEX, param="structured_outputs.regex", spec="[0-9]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}},
         Structured(kind=CHOICE, param="structured_outputs.choice", choices=("yes", "no"))),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}},
         Structured(kind=GRAMMAR, param="structured_outputs.grammar", spec='root ::= "a"')),
        ({"structured_outputs": {"json_object": True}},
         Structured(kind=OBJECT, param="structured_outputs.json_object")),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True,
                                 "disable_additional_properties": True,
                                 "whitespace_pattern": "[ ]?"}},
         Structured(kind=JSON, param="structured_outputs.json", spec=SCHEMA,
                    disable_any_whitespace=True, disable_additional_properties=True,
                    whitespace_pattern="[ ]?")),
        # vLLM's older guided_* names
        ({"guided_json": SCHEMA}, Structured(kind=JSON, param="guided_json", spec=SCHEMA)),
        ({"guided_regex": "a|b", "guided_whitespace_pattern": " "},
         Structured(kind=REGEX, param="guided_regex", spec="a|b", whitespace_pattern=" ")),
        ({"guided_choice": ["x"]}, Structured(kind=CHOICE, param="guided_choice", choices=("x",))),
        ({"guided_grammar": 'root ::= "a"'},
         Structured(kind=GRAMMAR, param="guided_grammar", spec='root ::= "a"')),
        # response_format plus structured_outputs options only (vLLM merges the two)
        ({"response_format": {"type": "json_object"},
          "structured_outputs": {"disable_any_whitespace": True}},
         Structured(kind=OBJECT, param="response_format", disable_any_whitespace=True)),
    ],
)  # fmt: skip
def test_every_openai_spelling_normalizes(body: dict[str, Any], want: Structured) -> None:
    assert openai(body) == want
    assert openai(body, chat=False) == want  # completions take the same keys


@pytest.mark.parametrize(
    ("sp", "want"),
    [
        ({"json_schema": '{"type":"object"}'},
         Structured(kind=JSON, param="sampling_params.json_schema", spec='{"type":"object"}')),
        ({"json_schema": SCHEMA},
         Structured(kind=JSON, param="sampling_params.json_schema", spec=SCHEMA)),
        ({"regex": "[a-z]+"}, Structured(kind=REGEX, param="sampling_params.regex", spec="[a-z]+")),
        ({"ebnf": 'root ::= "a"'},
         Structured(kind=GRAMMAR, param="sampling_params.ebnf", spec='root ::= "a"')),
    ],
)  # fmt: skip
def test_sglang_native_spellings_normalize(sp: dict[str, Any], want: Structured) -> None:
    assert native(sp) == want


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"response_format": {"type": "text"}},
        {"response_format": None, "guided_json": None, "structured_outputs": None},
        {"structured_outputs": {"json": None, "regex": None}},
    ],
)
def test_no_constraint(body: dict[str, Any]) -> None:
    assert openai(body) is None


def test_guided_decoding_backend_is_reported_as_ignored() -> None:
    _, opts = from_openai(
        {"guided_json": SCHEMA, "guided_decoding_backend": "outlines"},
        chat=True,
        **CTX,  # type: ignore[arg-type]
    )
    assert opts.ignored == ("guided_decoding_backend",)


def test_unknown_structured_outputs_fields_are_reported_as_ignored() -> None:
    params, opts = from_openai(
        {"structured_outputs": {"regex": "a", "frobnicate": 1}},
        chat=True,
        **CTX,  # type: ignore[arg-type]
    )
    assert params.structured is not None
    assert opts.ignored == ("structured_outputs.frobnicate",)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
        ({"response_format": _json_schema(SCHEMA), "structured_outputs": {"regex": "a"}},
         "structured_outputs.regex"),
        ({"structured_outputs": {"json": SCHEMA, "choice": ["a"]}}, "structured_outputs.choice"),
        ({"guided_regex": "a", "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
    ],
)  # fmt: skip
def test_two_constraints_are_a_400_naming_both(body: dict[str, Any], param: str) -> None:
    err = refused(body)
    assert err.param == param
    assert "only one structured output constraint" in err.message
    assert f"`{param}`" in err.message


def test_two_native_constraints_are_a_400() -> None:
    err = refused({"json_schema": "{}", "ebnf": 'root ::= "a"'}, is_native=True)
    assert err.param == "sampling_params.ebnf"


def _nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"x": node}}
    return node


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type", "structural"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name", "required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "required"),
        ({"response_format": _json_schema('{"type": "object"}')},
         "response_format.json_schema.schema", "must be an object"),
        ({"response_format": _json_schema([SCHEMA])},
         "response_format.json_schema.schema", "must be an object"),
        ({"response_format": _json_schema(SCHEMA, strict="yes")},
         "response_format.json_schema.strict", "boolean"),
        ({"response_format": _json_schema(_nested(MAX_SCHEMA_NESTING))},
         "response_format.json_schema.schema", "nested too deeply"),
        ({"guided_json": "{'type': 'object'}"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1, 2]"}, "guided_json", "JSON schema object"),
        ({"guided_json": "   "}, "guided_json", "empty"),
        ({"guided_json": 5}, "guided_json", "JSON schema object"),
        ({"structured_outputs": {"json": "true"}}, "structured_outputs.json", "object"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object",
         "must be true"),
        ({"structured_outputs": {"grammar": " \n"}}, "structured_outputs.grammar", "non-empty"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "string"),
        ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs.regex", "NUL"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "array"),
        ({"structured_outputs": {"choice": ["a\x00"]}}, "structured_outputs.choice", "NUL"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
         "not supported"),
        ({"structured_outputs": ["json"]}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs",
         "no constraint"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
         "structured_outputs.disable_any_whitespace", "boolean"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": 1}},
         "structured_outputs.whitespace_pattern", "string"),
        ({"guided_regex": "a", "guided_whitespace_pattern": 1}, "guided_whitespace_pattern",
         "string"),
        # An option with nothing to apply it to, in vLLM's older spelling too (it was ignored).
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "no constraint"),
    ],
)  # fmt: skip
def test_bad_constraints_are_a_400_naming_the_param(
    body: dict[str, Any], param: str, words: str
) -> None:
    err = refused(body)
    assert err.param == param
    assert words in err.message


def test_nesting_limit_is_vllms() -> None:
    """64 levels of objects/arrays pass (as in vLLM), one more is refused."""
    deepest_ok = _nested(MAX_SCHEMA_NESTING // 2 - 1)  # each level: an object and its properties
    assert openai({"guided_json": deepest_ok}) is not None
    assert openai({"guided_json": json.dumps(deepest_ok)}) is not None
    too_deep = _nested(MAX_SCHEMA_NESTING // 2)
    assert refused({"guided_json": too_deep}).param == "guided_json"
    assert refused({"guided_json": json.dumps(too_deep)}).param == "guided_json"


@pytest.mark.parametrize(
    ("sp", "param"),
    [
        ({"json_schema": "{"}, "sampling_params.json_schema"),
        ({"json_schema": "[]"}, "sampling_params.json_schema"),
        ({"regex": ["a"]}, "sampling_params.regex"),
        ({"ebnf": ""}, "sampling_params.ebnf"),
        ({"structural_tag": "{}"}, "sampling_params.structural_tag"),
    ],
)
def test_bad_native_constraints(sp: dict[str, Any], param: str) -> None:
    assert refused(sp, is_native=True).param == param


# -- the SGLang / TokenSpeed spelling (the vLLM one is tests/test_wire_vllm.py) ------------------


def test_grammar_fields_in_sglangs_spelling() -> None:
    schema = Structured(kind=JSON, param="p", spec={"a": "ü"})
    assert grammar_fields(schema) == ('{"a": "\\u00fc"}', None, None)  # json.dumps, as SGLang
    text = Structured(kind=JSON, param="p", spec='{"a":1}')
    assert grammar_fields(text) == ('{"a":1}', None, None)  # text passes as given
    assert grammar_fields(Structured(kind=OBJECT, param="p")) == (JSON_OBJECT_SCHEMA, None, None)
    assert grammar_fields(Structured(kind=REGEX, param="p", spec="a+")) == (None, "a+", None)
    assert grammar_fields(Structured(kind=GRAMMAR, param="p", spec="g")) == (None, None, "g")
    choice = Structured(kind=CHOICE, param="p", choices=("a.b", "c"))
    assert grammar_fields(choice) == (None, "(a\\.b|c)", None)
    assert grammar_fields(None) == (None, None, None)
    assert schema_text(Structured(kind=OBJECT, param="p")) == '{"type": "object"}'


@pytest.mark.parametrize(
    ("choices", "regex"),
    [
        (("yes", "no"), "(yes|no)"),
        (("a.b", "(x)", "[y]", "{2}", "a|b", "^$", "*+?", "back\\slash"),
         "(a\\.b|\\(x\\)|\\[y\\]|\\{2\\}|a\\|b|\\^\\$|\\*\\+\\?|back\\\\slash)"),
        (("new\nline", "tab\t", "cr\r", "\x01", "\x7f"),
         "(new\\nline|tab\\t|cr\\r|\\u0001|\\u007f)"),
        (("no way", "a-b", "#&~", 'say "hi"', "ünï 🙂"), '(no way|a-b|#&~|say "hi"|ünï 🙂)'),
    ],
)  # fmt: skip
def test_choice_regex_escapes_what_a_regex_reads(choices: tuple[str, ...], regex: str) -> None:
    """Only metacharacters get a backslash (xgrammar warns on other escapes), and control
    characters are \\n/\\t/\\r/\\uXXXX (xgrammar does not match \\xNN). That xgrammar accepts
    exactly the alternatives is checked on the real engines (tests/real_engines)."""
    assert choice_regex(choices) == regex


def test_a_schema_shared_by_a_requests_choices_is_written_out_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every choice of a request (up to 64) is its own engine request with the same Structured;
    # a 3 MB schema took 40 ms to write out as JSON, each time.
    written: list[object] = []
    dumps = json.dumps

    def counted(value: Any) -> str:
        written.append(value)
        text: str = dumps(value)
        return text

    monkeypatch.setattr(json, "dumps", counted)  # the json module smgd.wire.common uses
    one = Structured(kind=StructuredKind.JSON, param="guided_json", spec={"type": "object"})
    other = Structured(kind=StructuredKind.JSON, param="guided_json", spec={"type": "object"})
    texts = [common.grammar_fields(s)[0] for s in (one, one, one, other, other)]
    assert texts == ['{"type": "object"}'] * 5
    assert len(written) == 2  # once per constraint (equal ones are not compared)


def test_a_choice_list_shared_by_a_requests_choices_is_written_out_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 100,000 choices for 64 prompts: the regex (SGLang's form) or grammar (vLLM's) was built
    # for every engine request, a 4.2 s pause of every stream.
    built: list[str] = []
    for module, name in ((common, "choice_regex"), (vllm_encode, "choice_grammar")):
        build = getattr(module, name)

        def counted(choices: Any, _build: Any = build, _name: str = name) -> str:
            built.append(_name)
            return str(_build(choices))

        monkeypatch.setattr(module, name, counted)
    one = Structured(kind=StructuredKind.CHOICE, param="guided_choice", choices=("a", "b"))
    regexes = {common.grammar_fields(one)[1] for _ in range(3)}
    grammars = {vllm_encode.structured_outputs(one)["grammar"] for _ in range(3)}
    assert regexes == {"(a|b)"} and len(grammars) == 1
    assert built == ["choice_regex", "choice_grammar"]
