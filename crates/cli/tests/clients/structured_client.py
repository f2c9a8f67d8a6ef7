"""The unmodified `openai` Python client asking `tandem serve` for structured outputs: a
`json_schema` answer (whole and streamed) validated with `jsonschema`, a `json_object` answer
parsed, a named tool and `required` whose arguments are validated against the function's schema,
`auto` and an invalid schema refused by name. Prints one JSON object for the test to check.

usage: python structured_client.py BASE_URL MODEL SCHEMA_JSON QUESTION MAX_TOKENS
"""
import json
import sys

import jsonschema
import openai

base, model, schema, question, max_tokens = sys.argv[1:6]
schema, max_tokens = json.loads(schema), int(max_tokens)
client = openai.OpenAI(base_url=base, api_key="unused-on-loopback", max_retries=0, timeout=120)
messages = [{"role": "user", "content": question}]
fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}}
out = {}


def validated(text, schema):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=max_tokens, temperature=0, response_format=fmt
)
out["whole"] = {"text": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason}
validated(out["whole"]["text"], schema)

text = ""
for chunk in client.chat.completions.create(
    model=model, messages=messages, max_tokens=max_tokens, temperature=0, response_format=fmt,
    stream=True,
):
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
out["stream"] = text
validated(text, schema)

r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=max_tokens, temperature=0,
    response_format={"type": "json_object"},
)
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(r.choices[0].message.content), dict)
out["json_object"] = r.choices[0].message.content

weather = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
tools = [
    {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
    {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
        "additionalProperties": False}}},
]
ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
out["calls"] = []
for choice in [{"type": "function", "function": {"name": "get_weather"}}, "required"]:
    r = client.chat.completions.create(
        model=model, messages=ask, max_tokens=64, temperature=0, tools=tools, tool_choice=choice
    )
    call = r.choices[0].message.tool_calls[0]
    validated(call.function.arguments, params[call.function.name])
    out["calls"].append({"name": call.function.name, "arguments": call.function.arguments,
                         "finish_reason": r.choices[0].finish_reason})

refused = {}
for name, kwargs in {
    "auto": {"messages": ask, "tools": tools, "tool_choice": "auto"},
    "bad_schema": {"messages": messages, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wibble"}}}},
}.items():
    try:
        client.chat.completions.create(model=model, max_tokens=8, **kwargs)
        refused[name] = {"status": 200}
    except openai.BadRequestError as e:
        refused[name] = {"status": e.status_code, "param": e.body.get("param")}
out["refused"] = refused
print(json.dumps(out))
