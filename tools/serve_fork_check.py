#!/usr/bin/env python3
"""The server's uses of sequence forks, on any backend: a greedy chat completion with n = 2 (the
second choice is a fork of the first's prompt) must return two identical choices, and the same
request again (its prompt found in the prefix cache, forked from there) must return the same text;
then the same request with n = 1, which a server started with drafting (`--serve-arg=--draft ...`)
answers speculatively, must return that text too.

    python3 tools/serve_fork_check.py --binary target/release/megagemma --model tests/fixtures/gemma3 --backend cuda
    python3 tools/serve_fork_check.py --model tests/fixtures/ple_shared_dw --backend cuda \
        --serve-arg=--draft --serve-arg=mtp --serve-arg=--assistant --serve-arg=tests/fixtures/assistants/centroid

Prints one line per check and exits non-zero if any fails.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import Server, get_json, request_json  # noqa: E402


def post(url, body):
    return request_json(url, "POST", "/v1/chat/completions", None, body, timeout=600)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join("target", "release", "megagemma"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--serve-arg", action="append", default=[], help="one more argument for `serve` (repeat)")
    args = ap.parse_args()
    server_args = argparse.Namespace(binary=args.binary, model=args.model, backend=args.backend, max_batch=8,
                                     clients=[1], ctx=1024, threads=None, serve_arg=args.serve_arg,
                                     start_timeout=600)
    server = Server(server_args)
    failed = 0
    try:
        model = get_json(server.url, "/v1/models", None)["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "n": 2}
        first = post(server.url, body)
        texts = [c["message"]["content"] for c in first["choices"]]
        ok = len(texts) == 2 and texts[0] == texts[1] and texts[0] != ""
        print(f"{'ok' if ok else 'FAIL'} n=2 greedy: {len(texts)} choices, identical: {len(set(texts)) == 1}")
        failed += not ok
        again = post(server.url, body)
        texts2 = [c["message"]["content"] for c in again["choices"]]
        ok = texts2 == texts
        print(f"{'ok' if ok else 'FAIL'} the same request again (prefix cache): same text: {ok}")
        failed += not ok
        lone = post(server.url, dict(body, n=1))["choices"][0]["message"]["content"]
        ok = lone == texts[0]
        drafting = " ".join(args.serve_arg) or "no drafting"
        print(f"{'ok' if ok else 'FAIL'} n=1 ({drafting}): same text: {ok}")
        failed += not ok
    finally:
        server.stop()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
