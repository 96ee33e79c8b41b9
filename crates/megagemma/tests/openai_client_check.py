"""The official `openai` Python client against a running `megagemma serve` (URL as argv[1],
served model name as argv[2]): every call parses into the client's typed objects, streaming
matches the whole response, and errors raise the client's exception classes. Prints one line per
check and exits non-zero on the first failure (run by tests/serve_openai_client.rs)."""

import sys

import openai
from openai import OpenAI

url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
msgs = [{"role": "user", "content": "the cat sat"}]


def check(name, cond, detail=""):
    if not cond:
        sys.exit(f"FAIL {name}: {detail}")
    print(f"ok {name}")


models = client.models.list()
check("models.list", [m.id for m in models.data] == [model], models)

whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
c = whole.choices[0]
check("chat: typed response", whole.object == "chat.completion" and c.message.role == "assistant", whole)
check("chat: content", isinstance(c.message.content, str) and len(c.message.content) > 0, c)
check("chat: finish_reason", c.finish_reason in ("stop", "length"), c.finish_reason)
u = whole.usage
check("chat: usage", u.prompt_tokens > 0 and u.completion_tokens > 0
      and u.total_tokens == u.prompt_tokens + u.completion_tokens, u)

stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
text, usage, finish = "", None, None
for chunk in stream:
    check_obj = chunk.object == "chat.completion.chunk"
    if not check_obj:
        check("stream: chunk object", False, chunk)
    if chunk.usage is not None:
        usage = chunk.usage
    for ch in chunk.choices:
        text += ch.delta.content or ""
        finish = ch.finish_reason or finish
check("stream: same text as the whole response", text == c.message.content, (text, c.message.content))
check("stream: finish_reason", finish == c.finish_reason, finish)
check("stream: usage in the last chunk", usage is not None and usage.completion_tokens == u.completion_tokens, usage)

lp = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                    top_logprobs=3)
content = lp.choices[0].logprobs.content
check("chat: logprobs", len(content) == lp.usage.completion_tokens
      and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content), content)

several = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=1.0, seed=7, n=3)
check("chat: n=3", sorted(ch.index for ch in several.choices) == [0, 1, 2], several.choices)

comp = client.completions.create(model=model, prompt="the cat sat", max_tokens=8, temperature=0)
check("completions", comp.object == "text_completion" and isinstance(comp.choices[0].text, str)
      and comp.usage.completion_tokens > 0, comp)
comp_stream = client.completions.create(model=model, prompt="the cat sat", max_tokens=8, temperature=0,
                                        stream=True)
check("completions: stream equals whole", "".join(ch.choices[0].text for ch in comp_stream if ch.choices)
      == comp.choices[0].text)

try:
    client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
    check("unknown model raises", False, "no exception")
except openai.NotFoundError as e:
    check("unknown model raises NotFoundError (404)", e.status_code == 404, e)
try:
    client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=-1)
    check("bad temperature raises", False, "no exception")
except openai.BadRequestError as e:
    check("bad temperature raises BadRequestError (400)", e.status_code == 400 and "temperature" in str(e), e)
print("all checks passed")
