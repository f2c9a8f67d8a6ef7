"""The unmodified `openai` Python client against `tandem serve`: a chat completion, the same
streamed (with usage), a completion, and a bad request. Prints one JSON object for the test to
check against the target's greedy output.

usage: python openai_client.py BASE_URL MODEL CHAT_PROMPT COMPLETION_PROMPT MAX_TOKENS
"""
import json
import sys

import openai

base, model, chat_prompt, completion_prompt, max_tokens = sys.argv[1:6]
max_tokens = int(max_tokens)
client = openai.OpenAI(base_url=base, api_key="unused-on-loopback", max_retries=0, timeout=120)
out = {"openai_version": openai.__version__}

r = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": chat_prompt}],
    max_tokens=max_tokens,
    temperature=0,
)
out["chat"] = {
    "text": r.choices[0].message.content,
    "finish_reason": r.choices[0].finish_reason,
    "usage": r.usage.model_dump(),
    "object": r.object,
}

text, finish, usage, chunks = "", None, None, 0
for chunk in client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": chat_prompt}],
    max_tokens=max_tokens,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for c in chunk.choices:
        if c.delta.content:
            text += c.delta.content
        if c.finish_reason:
            finish = c.finish_reason
out["stream"] = {"text": text, "finish_reason": finish, "usage": usage, "chunks": chunks}

r = client.completions.create(
    model=model, prompt=completion_prompt, max_tokens=max_tokens, temperature=0
)
out["completion"] = {
    "text": r.choices[0].text,
    "finish_reason": r.choices[0].finish_reason,
    "usage": r.usage.model_dump(),
}

try:
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": chat_prompt}],
        max_tokens=max_tokens,
        temperature=7,
    )
    out["bad"] = {"status": 200}
except openai.BadRequestError as e:
    out["bad"] = {"status": e.status_code, "param": e.param, "message": e.message}

try:
    client.chat.completions.create(
        model="no-such-model",
        messages=[{"role": "user", "content": chat_prompt}],
        max_tokens=2,
    )
    out["unknown_model"] = {"status": 200}
except openai.NotFoundError as e:
    out["unknown_model"] = {"status": e.status_code, "message": e.message}

models = client.models.list()
out["models"] = [m.id for m in models.data]
print(json.dumps(out))
