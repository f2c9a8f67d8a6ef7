"""A conversation through the unmodified `openai` Python client, as every chat app holds one: a
system prompt, then a question per turn, the whole history sent each turn. Prints one JSON object:
each turn's answer, usage (with `prompt_tokens_details.cached_tokens`) and time to the answer.

usage: python chat_client.py BASE_URL MODEL MAX_TOKENS QUESTION...
"""
import json
import sys
import time

import openai

base, model, max_tokens = sys.argv[1:4]
questions = sys.argv[4:]
client = openai.OpenAI(base_url=base, api_key="unused-on-loopback", max_retries=0, timeout=300)
messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
turns = []
for q in questions:
    messages.append({"role": "user", "content": q})
    t0 = time.monotonic()
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=int(max_tokens), temperature=0
    )
    seconds = time.monotonic() - t0
    text = r.choices[0].message.content
    details = r.usage.prompt_tokens_details
    turns.append(
        {
            "text": text,
            "finish_reason": r.choices[0].finish_reason,
            "prompt_tokens": r.usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details is not None else None,
            "seconds": seconds,
        }
    )
    messages.append({"role": "assistant", "content": text})
print(json.dumps({"system": messages[0]["content"], "turns": turns}))
