#!/usr/bin/env python3
"""Serving benchmark: start `megagemma serve` (or use a running server), then run 1, 4, 16 and
32 concurrent clients that stream greedy chat completions of a fixed length, and report
requests/s, p50/p99 time to first token and aggregate decode tok/s. Python standard library only.

    python3 tools/bench_serve.py --model tests/fixtures/gemma3 --backend cpu
    python3 tools/bench_serve.py --model /path/gemma-3-270m-q4_k_m.gguf --backend cpu --max-tokens 32
    python3 tools/bench_serve.py --url http://127.0.0.1:8080      # a server already running

Every request asks for exactly --max-tokens tokens (`ignore_eos`, greedy), each with its own
prompt, so the figures measure the scheduler and the batched decode, not early stops. Each
client sends its requests one after another; a level's wall time runs from the first request
sent to the last stream closed.

  requests/s      completed requests / wall time
  TTFT p50/p99    request sent -> first generated token received (client side)
  aggregate tok/s completion tokens of all requests / wall time
  per-req tok/s   mean over requests of (tokens - 1) / (last token - first token): the decode
                  speed one client sees once its answer has started

A table, then one JSON line per run (`--json FILE` also writes it).
"""

import argparse
import http.client
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

TOPICS = [
    "the sea", "a lighthouse", "autumn leaves", "a train journey", "mountains", "a city at night",
    "the moon", "a garden", "winter", "a library", "rivers", "the desert", "a thunderstorm",
    "bread", "an old clock", "bicycles", "the forest", "snow", "a market", "stars", "coffee",
    "a bridge", "the wind", "a harbour", "birds", "a small village", "rain", "the ocean floor",
    "a violin", "glass", "the first day of spring", "a map",
]


def percentile(values, p):
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-p * len(s) // 100)) - 1))
    return s[k]


class Server:
    """A `megagemma serve` child on a free loopback port."""

    def __init__(self, args):
        cmd = [args.binary, "serve", "--model", args.model, "--port", "0", "--backend", args.backend,
               "--max-batch", str(args.max_batch), "--max-queue", str(max(64, 2 * max(args.clients)))]
        if args.ctx:
            cmd += ["--ctx", str(args.ctx)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        cmd += args.serve_arg
        self.cmd = cmd
        print("starting: " + " ".join(cmd), file=sys.stderr)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.url = None
        self.stderr_lines = []
        deadline = time.time() + args.start_timeout
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.stderr_lines.append(line.rstrip())
            m = re.search(r"on (http://[^ ]+)", line)
            if line.startswith("serving") and m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.stop()
            sys.exit("error: the server did not start: " + " | ".join(self.stderr_lines[-5:]))
        # Keep draining stderr so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line.rstrip())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def request_json(url, method, path, api_key, body=None, timeout=60):
    """One request; the decoded JSON reply (an error unless the status is 200)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"{method} {path}: {r.status} {data[:300]!r}")
    return json.loads(data)


def get_json(url, path, api_key):
    return request_json(url, "GET", path, api_key)


def stream_one(url, body, api_key, timeout):
    """One streamed chat completion. Returns (t_first, t_last, tokens, t_end) relative to send."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    r = conn.getresponse()
    if r.status != 200:
        msg = r.read()[:300]
        conn.close()
        raise RuntimeError(f"status {r.status}: {msg!r}")
    t_first = t_last = None
    counted = 0
    usage_tokens = None
    done = False
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
        for ch in chunk.get("choices", []):
            ids = ch.get("token_ids")
            content = (ch.get("delta") or {}).get("content")
            n = len(ids) if ids is not None else (1 if content else 0)
            if n:
                now = time.perf_counter() - t0
                if t_first is None:
                    t_first = now
                t_last = now
                counted += n
    t_end = time.perf_counter() - t0
    conn.close()
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    if t_first is None:
        raise RuntimeError("no token received")
    tokens = usage_tokens if usage_tokens is not None else counted
    return t_first, t_last, tokens, t_end


def run_level(args, url, model_name, clients, level_index):
    per_client = args.requests_per_client
    results = []
    errors = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(c):
        start.wait()
        for i in range(per_client):
            k = level_index * 100000 + c * per_client + i
            topic = TOPICS[k % len(TOPICS)]
            body = {
                "model": model_name,
                "messages": [{"role": "user", "content": f"Request {k}: write a short poem about {topic}."}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                "return_token_ids": True,
            }
            try:
                res = stream_one(url, body, args.api_key, args.request_timeout)
                with lock:
                    results.append(res)
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r[0] for r in results]
    tokens = sum(r[2] for r in results)
    per_req = [(r[2] - 1) / (r[1] - r[0]) for r in results if r[2] > 1 and r[1] > r[0]]
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 3) if wall > 0 else None,
        "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1) if ttft else None,
        "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1) if ttft else None,
        "aggregate_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "per_request_tok_s": round(statistics.mean(per_req), 2) if per_req else None,
        "completion_tokens": tokens,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="what `megagemma serve --model` takes (omit with --url)")
    ap.add_argument("--url", help="benchmark a server already running at this URL instead of starting one")
    ap.add_argument("--binary", default=os.path.join("target", "release", "megagemma"))
    ap.add_argument("--backend", default="cpu", help="cpu, cuda or auto (passed to serve)")
    ap.add_argument("--clients", default="1,4,16,32", help="concurrency levels, comma-separated")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=32, help="serve --max-batch")
    ap.add_argument("--ctx", type=int, default=1024, help="serve --ctx (0 = its default)")
    ap.add_argument("--threads", type=int, help="serve --threads")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more argument for serve (repeatable)")
    ap.add_argument("--api-key")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=1800)
    ap.add_argument("--json", help="also write the JSON result to this file")
    args = ap.parse_args()
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        sys.exit(f"error: --clients must be comma-separated integers, got `{args.clients}`")
    if not args.clients or min(args.clients) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        sys.exit("error: --clients, --requests-per-client and --max-tokens must be at least 1")
    if (args.model is None) == (args.url is None):
        sys.exit("error: give --model (start a server) or --url (use a running one)")

    server = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        if not os.path.exists(args.binary):
            sys.exit(f"error: {args.binary} not found: build it with `cargo build --release` or pass --binary")
        server = Server(args)
        url = server.url
    try:
        model_name = get_json(url, "/v1/models", args.api_key)["data"][0]["id"]
        warm = {"model": model_name, "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        for _ in range(args.warmup):
            stream_one(url, warm, args.api_key, args.request_timeout)
        levels = []
        for li, c in enumerate(args.clients):
            r = run_level(args, url, model_name, c, li)
            levels.append(r)
            print(f"clients {c:>3}: {r['requests']} requests, {r['errors']} errors, "
                  f"{r['requests_per_s']} req/s, TTFT p50 {r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms, "
                  f"{r['aggregate_tok_s']} tok/s aggregate, {r['per_request_tok_s']} tok/s per request",
                  file=sys.stderr, flush=True)
    finally:
        if server:
            server.stop()

    print(f"\nmodel {model_name} | max_tokens {args.max_tokens} | greedy | "
          f"{args.requests_per_client} requests per client")
    print(f"{'clients':>7} {'requests':>8} {'errors':>6} {'req/s':>8} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'agg tok/s':>9} {'req tok/s':>9}")
    for r in levels:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['errors']:>6} {r['requests_per_s']!s:>8} "
              f"{r['ttft_p50_ms']!s:>11} {r['ttft_p99_ms']!s:>11} {r['aggregate_tok_s']!s:>9} "
              f"{r['per_request_tok_s']!s:>9}")
    out = {
        "model": model_name,
        "server": " ".join(server.cmd) if server else url,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d"),
        "levels": levels,
    }
    line = json.dumps(out)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    failed = sum(r["errors"] for r in levels)
    if failed:
        print(f"error: {failed} requests failed; first: "
              f"{next(r['first_error'] for r in levels if r['first_error'])}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
